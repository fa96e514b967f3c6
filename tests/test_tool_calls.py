"""Function calling against a chat template that shows tools (a cut-down Qwen2.5 / Hermes one):
what the template gets (tools, replayed calls), /tokenize counting the same prompt, schemas with
$defs, and the stream of a "required" call list. The plain shapes are in test_openai_client.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tokenwire.stack import start_stack

# Tools into a system turn, replayed calls as <tool_call> with `arguments | tojson`, a description
# read straight off each tool (as Hermes-style templates do).
TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
{{ tool.function.name }}: {{ tool.function.description }} {{ tool.function.parameters | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.tool_calls %}{% for tc in message.tool_calls %}
<tool_call>{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}
{%- else %}
{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HELLO = [{"role": "user", "content": "Say hello."}]
PICK = {"type": "function", "function": {"name": "pick", "description": "pick a digit", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}
# What pydantic (openai.pydantic_function_tool) writes for a nested enum: $defs and a $ref.
UNIT = {"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object", "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
    "properties": {"u": {"$ref": "#/$defs/Unit"}}, "required": ["u"], "additionalProperties": False}}}
BARE = {"type": "function", "function": {"name": "ping"}}  # no description, no parameters


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory) -> Iterator[str]:
    model_dir = tmp_path_factory.mktemp("tool-template")
    for f in tiny_model_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    with start_stack(["--model", str(model_dir), "--load-format", "dummy", "--max-num-seqs", "4",
                      "--max-model-len", "512", "--device", "cpu"], timeout_s=180) as stack:
        yield stack.gateway_url


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model_of(url), "messages": HELLO, "max_tokens": 40, "temperature": 0, **body})


def tokenize(url: str, **body) -> dict:
    response = httpx.post(f"{url}/tokenize", json={"messages": HELLO, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def detokenize(url: str, tokens: list[int]) -> str:
    return httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]


def test_the_template_gets_the_tools_and_tokenize_counts_the_same_prompt(url: str) -> None:
    named = {"type": "function", "function": {"name": "pick"}}
    answer = chat(url, tools=[PICK, BARE], tool_choice=named)
    assert answer.status_code == 200, answer.text
    counted = tokenize(url, tools=[PICK, BARE])
    assert answer.json()["usage"]["prompt_tokens"] == counted["count"]
    prompt = detokenize(url, counted["tokens"])
    # Every field reaches the template, unset ones as null: a template reading them renders.
    assert "pick: pick a digit" in prompt and '"maximum": 9' in prompt and "ping: None null" in prompt
    # tool_choice "none" leaves them out of the prompt.
    plain = chat(url, tools=[PICK], tool_choice="none", max_tokens=2)
    assert plain.json()["usage"]["prompt_tokens"] == tokenize(url)["count"]


def test_replayed_calls_reach_the_template_with_their_arguments_as_objects(url: str) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "pick", "arguments": '{"a": 1}'}}
    history = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    prompt = detokenize(url, tokenize(url, messages=history, tools=[PICK])["tokens"])
    assert '<tool_call>{"name": "pick", "arguments": {"a": 1}}</tool_call>' in prompt
    bad = {**call, "function": {"name": "pick", "arguments": "{not json"}}
    refused = httpx.post(f"{url}/tokenize", json={"messages": [*HELLO, {"role": "assistant", "tool_calls": [bad]}]},
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_required_calls_resolve_defs_across_tools(url: str) -> None:
    # One call (parallel_tool_calls false), so the random model must close the list.
    answer = chat(url, tools=[PICK, UNIT], tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    for call in choice["message"]["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])
        assert arguments["u"] in ("c", "f") if call["function"]["name"] == "unit" else 0 <= arguments["a"] <= 9
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"Unit": {"type": "integer"}}, "properties": {"u": {"$ref": "#/$defs/Unit"}}}}}
    refused = chat(url, tools=[UNIT, clash], tool_choice="required")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    not_an_object = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
    refused = chat(url, tools=[not_an_object], tool_choice="required")
    assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("tools")
    beams = chat(url, tools=[PICK], tool_choice="required", use_beam_search=True, n=2)
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "tool_choice"


def test_a_streamed_required_list_sends_no_empty_chunks(url: str) -> None:
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": model_of(url), "messages": HELLO, "max_tokens": 60, "temperature": 0, "tools": [PICK],
            "tool_choice": "required", "parallel_tool_calls": False, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["delta"] or c["finish_reason"] for c in choices), choices
    last = choices[-1]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["tool_calls"][0]["function"]["name"] == "pick"
