"""Every request parameter of the gateway through the official openai client, stream and non-stream.

One stack (tiny random Llama, SmolLM2's tokenizer) for the module. Every response and every
chunk is also checked against OpenAI's published schema (test_openai_shapes.assert_openai_shape),
so these double as the golden test on live output.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import openai_client, tiny_stack
from tests.test_openai_shapes import assert_openai_shape
from tokenwire.stack import Stack

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
HELLO = [{"role": "user", "content": "Say hello."}]
# Its greedy continuation has no near-ties (top-2 logprob gap > 0.2 nats on the tiny model), so
# greedy-equivalent settings must pick the same tokens whatever the sampler's tie-breaking.
PROMPT = "Write a poem about the sea"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    with tiny_stack(tiny_model_dir, MAX_MODEL_LEN) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai_client(stack.gateway_url)


def shape(parsed: Any, stream: bool = False) -> None:
    # The SDK builds objects without validating; the keys it was given are the wire's keys.
    assert_openai_shape(parsed.model_dump(exclude_unset=True), stream=stream)


def chat(client: openai.OpenAI, model: str, **kw: Any) -> tuple[Any, list[Any]]:
    """The same chat request non-stream and stream (both shape-checked): (completion, chunks)."""
    kw.setdefault("messages", HELLO)
    full = client.chat.completions.create(model=model, **kw)
    shape(full)
    chunks = list(client.chat.completions.create(model=model, stream=True, **kw))
    for chunk in chunks:
        shape(chunk, stream=True)
    return full, chunks


def complete(client: openai.OpenAI, model: str, **kw: Any) -> tuple[Any, list[Any]]:
    kw.setdefault("prompt", PROMPT)
    full = client.completions.create(model=model, **kw)
    shape(full)
    chunks = list(client.completions.create(model=model, stream=True, **kw))
    for chunk in chunks:
        shape(chunk, stream=True)
    return full, chunks


def chat_texts(chunks: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


def completion_texts(chunks: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


def greedy_ids(client: openai.OpenAI, model: str, n: int = 6) -> list[int]:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
    tokenized = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                           json={"prompt": reply.choices[0].text, "add_special_tokens": False}, timeout=30).json()
    return tokenized["tokens"]


# ---- messages and prompts ----

def test_chat_roles_and_content_forms(client: openai.OpenAI, model: str) -> None:
    as_string = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Weather?"}]
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in as_string]
    a, _ = chat(client, model, messages=as_string, max_tokens=3, temperature=0)
    b, _ = chat(client, model, messages=as_parts, max_tokens=3, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message.content == b.choices[0].message.content
    developer, _ = chat(client, model, messages=[{"role": "developer", "content": "Be brief."}, *as_string[1:]],
                        max_tokens=3, temperature=0)
    assert developer.usage.prompt_tokens == a.usage.prompt_tokens
    tools = [*as_string, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with_tool, chunks = chat(client, model, messages=tools, max_tokens=3, temperature=0)
    assert with_tool.usage.prompt_tokens > a.usage.prompt_tokens
    assert chat_texts(chunks)[0] == with_tool.choices[0].message.content


def test_models_list_and_retrieve(client: openai.OpenAI, model: str) -> None:
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model" and card.model_dump()["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-this-model")
    # No name in the URL is not the served model (a body's empty "model" is): 404, never a card with no id.
    empty = httpx.get(str(client.base_url) + "models/")
    assert empty.status_code == 404 and empty.json()["error"]["code"] == "model_not_found"


def test_chat_template_controls(client: openai.OpenAI, model: str) -> None:
    """vLLM's add_generation_prompt, continue_final_message (assistant prefill) and
    chat_template_kwargs, on /v1/chat/completions and /tokenize alike."""
    root = str(client.base_url).removesuffix("/v1/")
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]

    def tokenize(**body: Any) -> httpx.Response:
        return httpx.post(f"{root}/tokenize", json={"messages": prefill, **body}, timeout=30)

    opened = tokenize().json()["tokens"]  # ends with a new assistant turn
    closed = tokenize(add_generation_prompt=False).json()["tokens"]
    continued = tokenize(add_generation_prompt=False, continue_final_message=True).json()["tokens"]
    words = httpx.post(f"{root}/tokenize", json={"prompt": " there", "add_special_tokens": False}, timeout=30).json()
    assert len(opened) > len(closed) > len(continued)
    assert continued[-len(words["tokens"]):] == words["tokens"]  # the last message left open: no end of turn
    assert closed[:len(continued)] == continued
    same = tokenize(add_generation_prompt=False, continue_final_message=True,
                    chat_template_kwargs={"enable_thinking": False}).json()["tokens"]
    assert same == continued  # a variable this template does not read changes nothing
    reply, chunks = chat(client, model, messages=prefill, max_tokens=3, temperature=0,
                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert reply.usage.prompt_tokens == len(continued)
    assert chat_texts(chunks)[0] == reply.choices[0].message.content
    # echo (vLLM's): the continued message's text first, then the same continuation, in both forms;
    # in a stream its own chunk after the role's, with continuous usage counting no output yet.
    echo_body = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    echoed, _ = chat(client, model, messages=prefill, max_tokens=3, temperature=0, n=2, extra_body=echo_body)
    echo_chunks = list(client.chat.completions.create(
        model=model, messages=prefill, max_tokens=3, temperature=0, n=2, stream=True,
        extra_body={**echo_body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    for chunk in echo_chunks:
        shape(chunk, stream=True)
    for index in (0, 1):
        assert echoed.choices[index].message.content == "Hello there" + reply.choices[0].message.content
        assert chat_texts(echo_chunks)[index] == echoed.choices[index].message.content
    echo_deltas = [c for c in echo_chunks if c.choices and c.choices[0].delta.content == "Hello there"]
    assert [c.choices[0].index for c in echo_deltas] == [0, 1]
    assert all(c.usage.completion_tokens == 0 for c in echo_deltas)
    assert echo_chunks.index(echo_deltas[0]) == 2  # after both role chunks
    # A last message of the user's is not the answer's start: nothing is echoed.
    plain, _ = chat(client, model, messages=prefill[:1], max_tokens=3, temperature=0, extra_body={"echo": True})
    assert plain.choices[0].message.content == chat(client, model, messages=prefill[:1], max_tokens=3,
                                                    temperature=0)[0].choices[0].message.content
    # Refused: both at once, and a template kwarg that would override apply_chat_template's own.
    for body in ({"continue_final_message": True}, {"chat_template_kwargs": {"tokenize": False}}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=prefill, max_tokens=3, extra_body=body)
        assert refused.value.status_code == 400
        assert tokenize(**body).status_code == 400
    # Tools the model may not call (tool_choice "none") are accepted and left unused.
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    unused, _ = chat(client, model, messages=prefill[:1], max_tokens=3, temperature=0, tools=[tool], tool_choice="none")
    assert unused.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=prefill[:1], max_tokens=3, tools=[tool])


def test_completion_prompt_forms(client: openai.OpenAI, model: str) -> None:
    ids = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize", json={"prompt": PROMPT},
                     timeout=30).json()["tokens"]
    by_text, _ = complete(client, model, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids, _ = complete(client, model, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    batch, chunks = complete(client, model, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert completion_texts(chunks) == {0: batch.choices[0].text, 1: batch.choices[1].text}
    id_batch, _ = complete(client, model, prompt=[ids, ids[:2]], max_tokens=4, temperature=0)
    assert id_batch.choices[0].text == by_text.choices[0].text
    assert id_batch.usage.prompt_tokens == len(ids) + 2


# ---- lengths and stopping ----

def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI, model: str) -> None:
    for kw in ({"max_tokens": 3}, {"max_completion_tokens": 3}, {"max_tokens": 9, "max_completion_tokens": 3}):
        full, chunks = chat(client, model, temperature=0, extra_body={"ignore_eos": True}, **kw)
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 3
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    full, _ = complete(client, model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 5


def test_stop_strings_and_include_stop_str(client: openai.OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), f"too little text to pick a stop string from: {free!r}"
    expected = free[:free.index(stop)]
    for form in (stop, [stop, "never-generated-xyz"]):
        full, chunks = complete(client, model, max_tokens=12, temperature=0, stop=form,
                                extra_body={"ignore_eos": True})
        assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
        assert completion_texts(chunks)[0] == expected
        # vLLM's stop_reason: the stop string that ended it, on the whole choice and the last chunk.
        assert full.model_dump()["choices"][0]["stop_reason"] == stop
        assert [c.model_dump()["choices"][0]["stop_reason"] for c in chunks if c.choices[0].finish_reason] == [stop]
    kept, _ = complete(client, model, max_tokens=12, temperature=0, stop=stop,
                       extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_min_tokens_holds_off_stop_strings(client: openai.OpenAI, model: str, smollm2) -> None:
    """vLLM's rule: a stop string counts where it ends after the first min_tokens tokens' text."""
    (there,) = smollm2.encode(" there", add_special_tokens=False).ids
    forced = {"logit_bias": {str(there): 100}, "max_tokens": 6, "temperature": 0, "stop": [" there"]}
    unheld, _ = complete(client, model, **forced, extra_body={"ignore_eos": True})
    assert unheld.choices[0].text == "" and unheld.choices[0].finish_reason == "stop"
    full, chunks = complete(client, model, **forced, n=2, extra_body={"ignore_eos": True, "min_tokens": 3})
    for choice in full.choices:
        assert choice.text == " there there there" and choice.finish_reason == "stop"
    assert full.usage.completion_tokens == 2 * 4  # the fourth token completed the stop
    assert completion_texts(chunks) == {0: " there there there", 1: " there there there"}
    reply, _ = chat(client, model, messages=[{"role": "user", "content": "hi"}], **forced,
                    extra_body={"ignore_eos": True, "min_tokens": 2})
    assert reply.choices[0].message.content == " there there"


def test_stop_token_ids_and_ignore_eos(client: openai.OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    first = greedy_ids(client, model)[1]
    full, chunks = complete(client, model, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [first]})
    assert full.choices[0].finish_reason == "stop" and full.usage.completion_tokens <= 2
    kept, kept_chunks = complete(client, model, max_tokens=6, temperature=0,
                                 extra_body={"stop_token_ids": [first], "include_stop_str_in_output": True})
    # The stop token counts in usage; its text is in the output only with include_stop_str_in_output
    # (as in vLLM), streamed or not.
    assert kept.usage.completion_tokens == full.usage.completion_tokens
    text, kept_text = full.choices[0].text, kept.choices[0].text
    assert completion_texts(chunks)[0] == text and completion_texts(kept_chunks)[0] == kept_text
    assert free.startswith(kept_text) and kept_text.startswith(text) and len(kept_text) > len(text), (text, kept_text)
    assert full.model_dump()["choices"][0]["stop_reason"] == first == kept.model_dump()["choices"][0]["stop_reason"]
    # Neither eos nor a length is a stop_reason (vLLM: null).
    eos = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"2": 100})
    long = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert eos.choices[0].finish_reason == "stop" and eos.model_dump()["choices"][0]["stop_reason"] is None
    assert long.choices[0].finish_reason == "length" and long.model_dump()["choices"][0]["stop_reason"] is None


# ---- sampling ----

def test_temperature_zero_top_p_and_top_k_pick_the_greedy_token(client: openai.OpenAI, model: str) -> None:
    greedy, chunks = complete(client, model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert completion_texts(chunks)[0] == greedy.choices[0].text
    tiny_p, _ = complete(client, model, max_tokens=6, temperature=1.0, top_p=1e-6, extra_body={"ignore_eos": True})
    top_1, _ = complete(client, model, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True, "top_k": 1})
    assert tiny_p.choices[0].text == greedy.choices[0].text == top_1.choices[0].text


def test_seed_reproduces_a_sample(client: openai.OpenAI, model: str) -> None:
    a, chunks = complete(client, model, max_tokens=8, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    b, _ = complete(client, model, max_tokens=8, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text == completion_texts(chunks)[0]


def test_n_choices_stream_interleaved_with_usage(client: openai.OpenAI, model: str) -> None:
    full, chunks = chat(client, model, n=3, max_tokens=4, temperature=1.0, seed=5,
                        stream_options=None, extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1, 2] and full.usage.completion_tokens == 12
    streamed = list(client.chat.completions.create(model=model, messages=HELLO, n=3, max_tokens=4, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
    indices = [c.choices[0].index for c in streamed if c.choices]
    assert set(indices) == {0, 1, 2}
    finishes = [c.choices[0].index for c in streamed if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in streamed[:-1])
    assert all(c.usage is None for c in chunks)  # without include_usage: no usage key at all



def test_continuous_usage_stats_gives_a_running_count_in_every_chunk(client: openai.OpenAI, model: str) -> None:
    streamed = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    running = [c.usage.completion_tokens for c in streamed if c.choices]
    assert running == sorted(running) and running[-1] == 6
    assert all(c.usage.prompt_tokens > 0 for c in streamed)
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 6
    chat_chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    # Every chunk, the opening role chunk included, carries the running count.
    assert chat_chunks[0].choices[0].delta.role == "assistant" and chat_chunks[0].usage.completion_tokens == 0
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chat_chunks)
    # With several choices each chunk counts its own choice and its own prompt (vLLM's
    # previous_num_tokens[i], num_prompt_tokens[prompt_idx]); the last chunk, the whole request.
    batch = list(client.completions.create(
        model=model, prompt=[[5, 6], [5, 6, 7, 8, 9]], n=2, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    for index, prompt_len in enumerate([2, 2, 5, 5]):
        counts = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in batch
                  if c.choices and c.choices[0].index == index]
        running = [n for _, n in counts]  # a chunk may carry two tokens (text held for a whole character)
        assert running == sorted(set(running)) and running[-1] == 3 and {p for p, _ in counts} == {prompt_len}
    assert (batch[-1].usage.prompt_tokens, batch[-1].usage.completion_tokens) == (7, 12)


def test_logprobs_chat_and_completions(client: openai.OpenAI, model: str) -> None:
    full, chunks = chat(client, model, max_tokens=4, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = full.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(bytes(t.bytes or []).decode(errors="replace") == t.token or t.token.startswith("bytes:")
               for t in content)
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.content or [] if c.choices and
                                            c.choices[0].logprobs else [])]
    assert len(streamed) == 4
    text_full, _ = complete(client, model, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = text_full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset == sorted(lp.text_offset) and all(len(t) >= 2 for t in lp.top_logprobs)


def test_echo_prepends_the_prompt(client: openai.OpenAI, model: str) -> None:
    plain, _ = complete(client, model, max_tokens=4, temperature=0)
    full, chunks = complete(client, model, max_tokens=4, temperature=0, echo=True)
    assert full.choices[0].text == PROMPT + plain.choices[0].text
    assert completion_texts(chunks)[0] == full.choices[0].text


def test_echo_of_token_ids_shows_them_as_the_tokenizer_reads_them(client: openai.OpenAI, model: str, smollm2) -> None:
    ids = smollm2.encode(PROMPT).ids
    plain, _ = complete(client, model, prompt=ids, max_tokens=3, temperature=0)
    full, chunks = complete(client, model, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert full.choices[0].text == smollm2.decode(ids) + plain.choices[0].text
    assert completion_texts(chunks)[0] == full.choices[0].text


def test_echo_with_logprobs_covers_prompt_tokens(client: openai.OpenAI, model: str) -> None:
    full, _ = complete(client, model, max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp = full.choices[0].logprobs
    num_prompt = full.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 2 and lp.token_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == full.choices[0].text
    assert full.model_dump()["choices"][0].get("prompt_logprobs") is None  # not asked for
    # prompt_logprobs asking for more alternatives: the echoed tokens still get logprobs=N's count
    # (plus the token itself where it is not among them), the prompt_logprobs field its own.
    more = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 5})
    echoed = more.choices[0].logprobs.top_logprobs[1:num_prompt]
    assert echoed and all(1 <= len(alternatives) <= 2 for alternatives in echoed), echoed
    prompt_logprobs = more.model_dump()["choices"][0]["prompt_logprobs"]
    assert all(len(entry) >= 5 for entry in prompt_logprobs[1:])
    # vLLM's entries: every prompt token's own rank too, not only its alternatives'.
    prompt_ids = [int(next(iter(entry))) for entry in prompt_logprobs[1:]]
    assert all(isinstance(entry[str(token)]["rank"], int) and entry[str(token)]["rank"] >= 1
               for token, entry in zip(prompt_ids, prompt_logprobs[1:], strict=True))


def test_echo_with_max_tokens_0_scores_the_prompt(client: openai.OpenAI, model: str) -> None:
    """vLLM's echo without generation (lm-evaluation-harness's loglikelihood requests): the prompt
    and its logprobs back, nothing generated, streamed or not."""
    full, chunks = complete(client, model, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = full.choices[0]
    assert choice.text == PROMPT and completion_texts(chunks)[0] == PROMPT
    assert full.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == PROMPT and len(choice.logprobs.tokens) == full.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None and all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    # The same numbers as the echoed prompt part of a request that generates.
    generating, _ = complete(client, model, max_tokens=2, echo=True, logprobs=1, temperature=0)
    assert generating.choices[0].logprobs.token_logprobs[:len(choice.logprobs.tokens)] == choice.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    assert "echo" in str(refused.value)


def test_prompt_logprobs(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 1})
    prompt_logprobs = full.model_dump()["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == full.usage.prompt_tokens
    assert all(entry for entry in prompt_logprobs[1:])


def test_user_and_unknown_fields_are_accepted(client: openai.OpenAI, model: str) -> None:
    full, _ = chat(client, model, max_tokens=2, user="user-42", extra_body={"some_future_field": {"x": 1}})
    assert full.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_forces_a_token(client: openai.OpenAI, model: str) -> None:
    forced = greedy_ids(client, model)[0] + 1
    full, chunks = complete(client, model, max_tokens=3, temperature=0, logprobs=0, logit_bias={str(forced): 100},
                            extra_body={"ignore_eos": True})
    tokens = full.choices[0].logprobs.tokens
    assert len(set(tokens)) == 1 and completion_texts(chunks)[0] == full.choices[0].text


def test_allowed_token_ids_restrict_the_output(client: openai.OpenAI, model: str) -> None:
    allowed = greedy_ids(client, model)[0] + 7
    full, _ = complete(client, model, max_tokens=3, temperature=1.0, logprobs=0,
                       extra_body={"allowed_token_ids": [allowed], "ignore_eos": True})
    assert len(set(full.choices[0].logprobs.tokens)) == 1


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"extra_body": {"repetition_penalty": 3.0}}])
def test_penalties_change_a_repetitive_greedy_output(client: openai.OpenAI, model: str,
                                                     penalty: dict[str, Any]) -> None:
    # The tiny random model repeats one token greedily; any of these penalties breaks the loop.
    base, _ = complete(client, model, max_tokens=8, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    kw = {**penalty, "extra_body": {"ignore_eos": True, **penalty.get("extra_body", {})}}
    full, chunks = complete(client, model, max_tokens=8, temperature=0, logprobs=0, **kw)
    assert full.choices[0].text != base.choices[0].text and completion_texts(chunks)[0] == full.choices[0].text


def test_bad_words_are_never_generated(client: openai.OpenAI, model: str) -> None:
    base, _ = complete(client, model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    word = base.choices[0].text.split()[0]
    full, _ = complete(client, model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True,
                                                                               "bad_words": [word]})
    assert word not in full.choices[0].text


def test_min_tokens_holds_back_stop_ids(client: openai.OpenAI, model: str) -> None:
    first = greedy_ids(client, model)[0]
    full, _ = complete(client, model, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [first],
                                                                               "min_tokens": 3})
    assert full.usage.completion_tokens >= 3


def test_min_p_one_keeps_only_the_top_token(client: openai.OpenAI, model: str) -> None:
    greedy, _ = complete(client, model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    full, _ = complete(client, model, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True, "min_p": 1.0})
    assert full.choices[0].text == greedy.choices[0].text


def test_typical_p_and_skip_special_tokens_are_accepted(client: openai.OpenAI, model: str) -> None:
    # No observable effect to assert on a random model; these check the values get through.
    full, _ = complete(client, model, max_tokens=3, extra_body={"typical_p": 0.5, "skip_special_tokens": False})
    assert full.usage.completion_tokens >= 1


def test_best_of_returns_n(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=1, best_of=3)
    shape(full)
    assert len(full.choices) == 1 and full.choices[0].finish_reason in ("stop", "length")


def test_beam_search_returns_distinct_beams(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2, temperature=0,
                                     extra_body={"use_beam_search": True, "best_of": 2, "length_penalty": 1.0,
                                                 "ignore_eos": True})
    shape(full)
    assert len(full.choices) == 2 and full.choices[0].text != full.choices[1].text


def test_response_format_json_schema_gives_valid_json(client: openai.OpenAI, model: str) -> None:
    # Bounded fields and no extra properties, so even the tiny random model must finish the object.
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    full, chunks = chat(client, model, max_tokens=40, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    parsed = json.loads(full.choices[0].message.content)
    assert set(parsed) == {"a", "b"} and 0 <= parsed["a"] <= 9 and isinstance(parsed["b"], bool)
    assert full.choices[0].finish_reason == "stop"
    assert chat_texts(chunks)[0] == full.choices[0].message.content


# Bounded arguments and no extra properties, so even the tiny random model must finish each call.
PICK = {"type": "function", "function": {"name": "pick", "description": "pick a digit", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}
FLAG = {"type": "function", "function": {"name": "flag", "parameters": {
    "type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"], "additionalProperties": False}}}


def test_a_named_tool_choice_calls_that_function_with_valid_arguments(client: openai.OpenAI, model: str) -> None:
    full, chunks = chat(client, model, max_tokens=40, temperature=0, tools=[PICK, FLAG],
                        tool_choice={"type": "function", "function": {"name": "pick"}})
    message = full.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "pick" and call.id
    assert 0 <= json.loads(call.function.arguments)["a"] <= 9
    assert full.choices[0].finish_reason == "stop"  # OpenAI's for a forced named call
    # Streamed as vLLM streams it: the call opens with its id and name, its arguments follow as they come.
    pieces = [tc for c in chunks for choice in c.choices for tc in (choice.delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "pick" and all(p.index == 0 for p in pieces)
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert not any(choice.delta.content for c in chunks for choice in c.choices)


def test_required_tool_choice_returns_calls_of_the_tools(client: openai.OpenAI, model: str) -> None:
    full, chunks = chat(client, model, max_tokens=60, temperature=0, tools=[PICK, FLAG], tool_choice="required")
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and all(c.function.name in ("pick", "flag") for c in choice.message.tool_calls)
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == ({"a"} if call.function.name == "pick" else {"b"})
    # Streamed whole with the last event, once the list parses.
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "tool_calls"
    assert [(t.index, t.function.name, t.function.arguments) for t in last.delta.tool_calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [PICK]}, "tool_choice"),  # "auto", the default with tools: no tool-call parser here
    ({"tools": [PICK], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [PICK], "tool_choice": {"type": "function", "function": {"name": "flag"}}}, "tool_choice"),
    ({"tools": [PICK], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, "tools"),
])
def test_tool_choices_it_cannot_serve_are_refused(client: openai.OpenAI, model: str, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=HELLO, max_tokens=3, extra_body=body)
    assert refused.value.status_code == 400 and refused.value.body["param"].startswith(param)


@pytest.mark.parametrize(("body", "param"), [({"n": 20}, "n"), ({"n": 2, "best_of": 20}, "best_of")])
def test_more_samples_than_the_model_worker_runs_at_once_are_refused_by_it(
        client: openai.OpenAI, model: str, body: dict, param: str) -> None:
    # Within OpenAI's bound (128), past this stack's --max-num-seqs 8: the model worker's 400.
    with pytest.raises(openai.BadRequestError, match="must be <= 8, not 20") as refused:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=3, extra_body=body)
    assert refused.value.body["param"] == param


def test_response_format_json_object_constrains_the_output(client: openai.OpenAI, model: str) -> None:
    # Free-form objects may outrun max_tokens on a random model: the text must still be JSON so far.
    full, _ = chat(client, model, max_tokens=40, temperature=0, extra_body={"response_format": {"type": "json_object"}})
    content = full.choices[0].message.content
    assert content.lstrip().startswith("{")
    if full.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_guided_choice_picks_one(client: openai.OpenAI, model: str) -> None:
    full, _ = complete(client, model, max_tokens=5, extra_body={"guided_choice": ["yes", "no"]})
    assert full.choices[0].text in ("yes", "no")
    # vLLM >= 0.12's structured_outputs, the same constraint.
    full, chunks = chat(client, model, max_tokens=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert full.choices[0].message.content in ("yes", "no") and chat_texts(chunks)[0] in ("yes", "no")


def test_truncate_prompt_tokens_keeps_the_prompts_end(client: openai.OpenAI, model: str, stack: Stack) -> None:
    long_prompt = "one two three " * 200  # 600 tokens, past the 256 of the context
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=long_prompt, max_tokens=2)
    ids = httpx.post(f"{stack.gateway_url}/tokenize", json={"prompt": long_prompt}, timeout=30).json()["tokens"]
    cut = client.completions.create(model=model, prompt=long_prompt, max_tokens=2, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 50})
    same = client.completions.create(model=model, prompt=ids[-50:], max_tokens=2, temperature=0)
    assert cut.usage.prompt_tokens == 50 and cut.choices[0].text.endswith(same.choices[0].text)
    assert len(cut.choices[0].text) < len(long_prompt)  # the echo is the prompt the model read
    messages = [{"role": "user", "content": long_prompt}]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                            extra_body={"truncate_prompt_tokens": -1})  # all that fits
    assert answer.usage.prompt_tokens == MAX_MODEL_LEN - 2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert info.value.body["param"] == "truncate_prompt_tokens"
    # No cut leaves room for max_tokens: the refusal counts the prompt as sent.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=ids[:12], max_tokens=MAX_MODEL_LEN,
                                  extra_body={"truncate_prompt_tokens": -1})
    assert "12 in the" in str(info.value), info.value


def test_model_may_be_left_out(stack: Stack, model: str) -> None:
    for left_out in ({}, {"model": ""}, {"model": None}):
        answer = httpx.post(f"{stack.gateway_url}/v1/chat/completions", timeout=30,
                            json={"messages": HELLO, "max_tokens": 2, **left_out}).json()
        assert answer["model"] == model and answer["choices"][0]["message"]["content"] is not None


# ---- errors ----

@pytest.mark.parametrize("kw", [
    {"temperature": 3}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0}, {"presence_penalty": 9}, {"logit_bias": {"x": 1}},
    {"stop": ""}, {"extra_body": {"min_p": 2}}, {"extra_body": {"top_k": -5}}, {"extra_body": {"best_of": 1}, "n": 2},
    {"extra_body": {"allowed_token_ids": [10**9]}}, {"logprobs": 99}, {"seed": "x"}, {"seed": 2**63},
    {"seed": -(2**63) - 1},
])
def test_bad_values_are_400(client: openai.OpenAI, model: str, kw: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, **{"max_tokens": 2, **kw})
    assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_prompt_longer_than_context_says_both_lengths(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN} tokens") as info:
        client.completions.create(model=model, prompt="hi " * (MAX_MODEL_LEN + 10), max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match=r"\(\d+ in the messages, 250 in the completion\)"):
        client.chat.completions.create(model=model, messages=HELLO, max_tokens=250)



# ---- limits ----

def test_request_limits_are_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stop=[str(i) for i in range(17)])
    assert info.value.status_code == 400 and "at most 16 stop strings" in info.value.message


def test_a_model_worker_refusal_names_the_parameter(client: openai.OpenAI, model: str) -> None:
    # The tiny stack runs 8 sequences at once; the gateway's own limit is 16.
    for kw, param in (({"n": 12}, "n"), ({"extra_body": {"best_of": 12}}, "best_of")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=2, **kw)
        assert "must be <= 8" in str(info.value) and info.value.param == param
    # The sampler's checks name theirs too (min_tokens past the output budget: a chat request
    # without max_tokens has the rest of the context).
    with pytest.raises(openai.BadRequestError, match="min_tokens") as info:
        client.chat.completions.create(model=model, messages=HELLO, extra_body={"min_tokens": 300})
    assert info.value.param == "min_tokens"


def test_return_tokens_as_token_ids_labels_the_logprob_tokens(client: openai.OpenAI, model: str,
                                                             stack: Stack) -> None:
    full, chunks = chat(client, model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    entries = full.choices[0].logprobs.content
    assert len(entries) == 4 and all(e.token.startswith("token_id:") for e in entries)
    ids = [int(e.token.removeprefix("token_id:")) for e in entries]
    text = httpx.post(f"{stack.gateway_url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == full.choices[0].message.content
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
    # The bytes are still the token's own: they join to the text.
    assert b"".join(bytes(e.bytes) for e in entries).decode() == full.choices[0].message.content
    streamed = [e.token for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert streamed == [e.token for e in entries]
    done, _ = complete(client, model, max_tokens=3, temperature=0, logprobs=1,
                       extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in done.choices[0].logprobs.tokens)
