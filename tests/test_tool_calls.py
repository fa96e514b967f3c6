"""Function calling against a chat template that shows tools (a cut-down Qwen2.5 / Hermes one):
what the template gets (tools, replayed calls), /tokenize counting the same prompt, schemas with
$defs, the stream of a "required" call list, tool_choice "auto" with the gateway's hermes parser
(the random model's output forced by a regex), and the deepseek_r1 reasoning parser, which takes a
free output (no closing </think>) for thinking, and holds a constraint back until the thinking ends. The plain shapes are in test_openai_client.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tokenwire.stack import start_stack

# Tools into a system turn, replayed calls as <tool_call> with `arguments | tojson`, a description
# read straight off each tool (as Hermes-style templates do); Qwen3's generation prompt, which
# closes an empty thinking block unless enable_thinking (here off by default, so the forced
# outputs below are answers, constrained from their first token).
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
{% if not enable_thinking | default(false) %}<think>

</think>

{% endif %}{% endif %}"""
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}

HELLO = [{"role": "user", "content": "Say hello."}]
PICK = {"type": "function", "function": {"name": "pick", "description": "pick a digit", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}
# What pydantic (openai.pydantic_function_tool) writes for a nested enum: $defs and a $ref.
UNIT = {"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object", "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
    "properties": {"u": {"$ref": "#/$defs/Unit"}}, "required": ["u"], "additionalProperties": False}}}
BARE = {"type": "function", "function": {"name": "ping"}}  # no description, no parameters


THINK_END_ID = 15  # "</think>" in single_token_think_tags' vocabulary


def single_token_think_tags(tokenizer_json: Path) -> None:
    """<think> and </think> as one token each, as in Qwen3's and R1's vocabularies (the model worker
    finds the end of the thinking by its token): two unused SmolLM2 special tokens renamed, and left
    special, as some vocabularies mark them (the gateway keeps them in the text: skip_special_tokens
    would drop the very tag the parser splits at)."""
    tokenizer = json.loads(tokenizer_json.read_text())
    renames = {"<jupyter_script>": "</think>", "<empty_output>": "<think>"}
    for added in tokenizer["added_tokens"]:
        if added["content"] in renames:
            added["content"] = renames[added["content"]]
    vocab = tokenizer["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    assert vocab["</think>"] == THINK_END_ID
    tokenizer_json.write_text(json.dumps(tokenizer))


THINK_START_ID = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("tool-template")
    for f in tiny_model_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    single_token_think_tags(model_dir / "tokenizer.json")
    return model_dir


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    with start_stack(["--model", str(model_dir), "--load-format", "dummy", "--max-num-seqs", "4",
                      "--max-model-len", "512", "--device", "cpu"], timeout_s=180,
                     gateway_args=["--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"]) as stack:
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
    # tool_choice "none" still shows them (OpenAI's and vLLM's default): the model knows them, calls none.
    plain = chat(url, tools=[PICK], tool_choice="none", max_tokens=2)
    assert plain.json()["usage"]["prompt_tokens"] == tokenize(url, tools=[PICK])["count"] > tokenize(url)["count"]
    assert not plain.json()["choices"][0]["message"].get("tool_calls")


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
    # Each tool's pointers mean its own schema in the list: the same $defs name in two tools, draft-07
    # "definitions", "#" (a tree), a "#/properties/..." pointer. The model worker's grammar takes them all.
    same_name = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"Unit": {"type": "integer"}}, "properties": {"u": {"$ref": "#/$defs/Unit"}},
        "required": ["u"]}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "definitions": {"L": {"type": "string", "maxLength": 3}},
        "properties": {"label": {"$ref": "#/definitions/L"}, "again": {"$ref": "#/properties/label"},
                       "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
        "required": ["label"], "additionalProperties": False}}}
    tools = [UNIT, same_name, tree]
    called = set()
    for seed in range(6):
        answer = chat(url, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                      temperature=1.0, seed=seed)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            continue  # cut by max_tokens
        [call] = choice["message"]["tool_calls"]
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        called.add(call["function"]["name"])
    assert len(called) >= 2, called  # whole calls, of more than one tool
    for defs in (["x"], "x", 5):  # not an object (the "required" list's gathering of them was a 500)
        odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "$defs": defs}}}
        for choice in ("required", {"type": "function", "function": {"name": "odd"}}):
            answer = chat(url, tools=[odd], tool_choice=choice)
            assert answer.status_code == 200, (defs, choice, answer.text)  # the grammar ignores them
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


# What a Hermes-style model writes when it decides to call: some words, then the call in tags.
CALLING = 'Let me pick.\n<tool_call>\n{"name": "pick", "arguments": {"a": 7}}\n</tool_call>'


def forced(text: str) -> dict:
    """extra_body making the random model write exactly text."""
    return {"guided_regex": "".join("\\" + c if c in "\\.^$*+?{}[]|()" else c for c in text)}


def test_auto_finds_the_call_the_model_writes(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model = model_of(url)
    answer = client.chat.completions.create(model=model, messages=HELLO, max_tokens=150, temperature=0,
                                            tools=[PICK, BARE], extra_body=forced(CALLING))
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Let me pick."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "pick"
    assert json.loads(call.function.arguments) == {"a": 7}
    # Streamed: the SDK's own accumulator makes the same message of the deltas.
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model=model, messages=HELLO, max_tokens=150, temperature=0,
                                                tools=[PICK, BARE], extra_body=forced(CALLING), stream=True,
                                                tool_choice="auto"):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == "Let me pick."
    [streamed_call] = streamed.message.tool_calls
    assert (streamed_call.function.name, json.loads(streamed_call.function.arguments)) == ("pick", {"a": 7})


def test_auto_without_a_call_answers_the_text_as_it_was_written(url: str) -> None:
    text = "No tool needed <tool here> </tool_call>\n"
    answer = chat(url, tools=[PICK], max_tokens=60, **forced(text))
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text
    assert "tool_calls" not in choice["message"]
    # A block that is no call stays in the content, tags and all.
    broken = 'Hm <tool_call>{"name": "pick", "arguments": 7}</tool_call>'
    answer = chat(url, tools=[PICK], max_tokens=80, **forced(broken)).json()["choices"][0]
    assert answer["message"]["content"] == broken and answer["finish_reason"] == "stop"


def test_auto_streams_each_call_whole_and_the_content_around_it(url: str) -> None:
    two = '<tool_call>{"name": "pick", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": model_of(url), "messages": HELLO, "max_tokens": 150, "temperature": 0, "tools": [PICK, BARE],
            "stream": True, **forced(two)}) as response:
        choices = [c for line in response.iter_lines() if line.startswith("data: {")
                   for c in json.loads(line[6:])["choices"]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["delta"] or c["finish_reason"] for c in choices), choices  # no empty chunks
    calls = [tc for c in choices for tc in c["delta"].get("tool_calls", [])]
    assert [(tc["index"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] == [
        (0, "pick", {"a": 1}), (1, "ping", {})]
    assert all(tc["id"] and tc["type"] == "function" for tc in calls)
    assert not any(c["delta"].get("content") for c in choices[1:])  # only whitespace between the calls
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_a_free_output_is_thinking_under_deepseek_r1_and_a_constraint_waits_for_its_end(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model = model_of(url)
    answer = client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0,
                                            extra_body=THINKING)
    message = answer.choices[0].message.model_dump()
    # The random model never writes </think>: all it wrote is reasoning, no content (vLLM's rule).
    assert message["content"] is None and message["reasoning"] and message["reasoning"] == message["reasoning_content"]
    streamed = list(client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0,
                                                   stream=True, extra_body=THINKING))
    deltas = [c.choices[0].delta.model_dump() for c in streamed if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert not any(d.get("content") for d in deltas)
    # Structured output constrains the answer: the thinking before </think> is free (vLLM's rule),
    # so with a model that never closes it the output is all (free) thinking...
    waiting = client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0,
                                             extra_body={**THINKING, **forced("Hello there")})
    assert waiting.choices[0].message.model_dump() == message
    # ... and once it writes </think> (biased to come first here), the answer is the grammar's,
    # whitespace and all, streamed or whole; a forced call's arguments too.
    closing = {**THINKING, "logit_bias": {str(THINK_END_ID): 100}}
    answered = client.chat.completions.create(model=model, messages=HELLO, max_tokens=20, temperature=0,
                                              extra_body={**closing, **forced(" Hello there")})
    assert answered.choices[0].message.content == " Hello there", answered
    streamed = list(client.chat.completions.create(model=model, messages=HELLO, max_tokens=20, temperature=0,
                                                   stream=True, extra_body={**closing, **forced(" Hello there")}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == " Hello there"
    call = client.chat.completions.create(model=model, messages=HELLO, max_tokens=40, temperature=0, tools=[PICK],
                                          tool_choice={"type": "function", "function": {"name": "pick"}},
                                          extra_body=closing).choices[0].message.tool_calls[0]
    assert call.function.name == "pick" and json.loads(call.function.arguments)["a"] in range(10)
    # ... and after a prompt that closed the thinking, it is constrained from the first token.
    closed = [*HELLO, {"role": "assistant", "content": "<think>\nok\n</think>\n\n"}]
    forced_text = client.chat.completions.create(
        model=model, messages=closed, max_tokens=20, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, **forced("Hello there")})
    assert forced_text.choices[0].message.content == "Hello there"
    assert "reasoning" not in forced_text.choices[0].message.model_dump(exclude_unset=True)


def test_an_answer_continued_after_a_closed_thought_is_content(url: str) -> None:
    # The prompt's own </think> (continue_final_message) puts the output in the answer, stream or not.
    prefill = [*HELLO, {"role": "assistant", "content": "<think>\nsimple\n</think>\n\nThe answer is"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 8}
    message = chat(url, **body).json()["choices"][0]["message"]
    assert message["content"] and message.get("reasoning") is None, message
    streamed = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": model_of(url), "temperature": 0, "stream": True, **body}).text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.splitlines()
              if line.startswith("data: {") and '"choices":[{' in line]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any(d.get("reasoning") for d in deltas)
    # So is an answer prefilled without tags (templates strip the thinking of assistant messages).
    untagged = [*HELLO, {"role": "assistant", "content": "The answer is"}]
    message = chat(url, **{**body, "messages": untagged}).json()["choices"][0]["message"]
    assert message["content"] and message.get("reasoning") is None, message


def test_auto_with_parallel_tool_calls_false_keeps_the_first_call(url: str) -> None:
    two = ('<tool_call>{"name": "pick", "arguments": {"a": 1}}</tool_call>\n'
           '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    body = {"tools": [PICK, BARE], "parallel_tool_calls": False, **forced(two)}
    answer = chat(url, max_tokens=150, **body).json()["choices"][0]
    assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == ["pick"]
    assert answer["finish_reason"] == "tool_calls"
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": model_of(url), "messages": HELLO, "max_tokens": 150, "temperature": 0, "stream": True,
            **body}) as response:
        choices = [c for line in response.iter_lines() if line.startswith("data: {")
                   for c in json.loads(line[6:])["choices"]]
    assert [tc["function"]["name"] for c in choices for tc in c["delta"].get("tool_calls", [])] == ["pick"]


def test_a_replayed_call_nested_past_the_parser_is_a_400(url: str) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "pick", "arguments": "[" * 5000}}
    refused = httpx.post(f"{url}/tokenize", timeout=60,
                         json={"messages": [*HELLO, {"role": "assistant", "tool_calls": [call]}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_qwen3_lets_the_first_token_open_the_thinking_or_start_the_constrained_answer(model_dir: Path) -> None:
    # After a generation prompt without tags (Qwen3's thinking mode), qwen3 reads the output as
    # thinking only if it opens with <think>: the model worker lets the first token be <think> (then
    # the grammar waits for </think>) or the grammar's own (then the answer is constrained from it).
    with start_stack(["--model", str(model_dir), "--load-format", "dummy", "--max-num-seqs", "4",
                      "--max-model-len", "512", "--device", "cpu"], timeout_s=180,
                     gateway_args=["--reasoning-parser", "qwen3"]) as stack:
        client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none")
        model = model_of(stack.gateway_url)

        def answer(bias: dict[int, int], stream: bool = False) -> dict:
            body = {**THINKING, **forced(" Hello there"), "logit_bias": {str(t): b for t, b in bias.items()}}
            if not stream:
                choice = client.chat.completions.create(model=model, messages=HELLO, max_tokens=20, temperature=0,
                                                        logprobs=True, extra_body=body).choices[0]
                return {**choice.message.model_dump(), "tokens": [t.token for t in choice.logprobs.content]}
            chunks = list(client.chat.completions.create(model=model, messages=HELLO, max_tokens=20, temperature=0,
                                                         stream=True, extra_body=body))
            deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
            return {"content": "".join(d.get("content") or "" for d in deltas) or None,
                    "reasoning": "".join(d.get("reasoning") or "" for d in deltas) or None}

        # Opening (biased; </think> more, but the grammar masks it on the first token): thinks, then answers.
        for stream in (False, True):
            opened = answer({THINK_START_ID: 50, THINK_END_ID: 100}, stream)
            assert (opened["content"], opened.get("reasoning")) == (" Hello there", None), opened
            if not stream:  # the thinking did open (a grammar from the first token masks <think>)
                assert opened["tokens"][:2] == ["<think>", "</think>"], opened
        # Not opening: the answer is the grammar's from the first token.
        straight = answer({THINK_START_ID: -100})
        assert (straight["content"], straight.get("reasoning")) == (" Hello there", None), straight
        assert "<think>" not in straight["tokens"]
