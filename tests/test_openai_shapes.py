"""Golden test of response shapes against OpenAI's published schema, as the openai package types it.

assert_openai_shape validates a body with the SDK's own model (ChatCompletion, ChatCompletionChunk,
Completion) and checks that no field OpenAI's API returns is missing, recursively. The tests
below run it on every kind of body the responders build; test_openai_client.py runs it on every
response and chunk of the live gateway.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import openai.types as oai
import openai.types.chat as oai_chat
import openai.types.chat.chat_completion as oai_chat_completion
import openai.types.chat.chat_completion_chunk as oai_chunk
import openai.types.completion_choice as oai_completion_choice
import openai.types.completion_usage as oai_usage
import pytest
from pydantic import BaseModel

from gateway.request_state import GenerationEvent, PromptLogprobs
from gateway.responses import ChatResponder, ChoiceOutput, CompletionResponder, PromptEcho, sse_event, usage
from tests.test_gateway_responses import ByteSpeller

# Fields of the SDK's types that OpenAI's API itself leaves out for the requests we serve (no
# automatic tool calls, audio, moderation, service tiers, token details); everything else must be present.
_MAY_BE_ABSENT: dict[type[BaseModel], set[str]] = {
    oai_chat.ChatCompletion: {"metadata", "moderation", "service_tier"},
    oai_chat.ChatCompletionMessage: {"annotations", "audio", "function_call", "tool_calls"},
    oai_chat.ChatCompletionChunk: {"moderation", "obfuscation", "service_tier", "usage"},
    # Deltas carry only what changed: role and content on the first, content after, {} at the end.
    oai_chunk.ChoiceDelta: {"audio", "content", "function_call", "refusal", "role", "tool_calls"},
    # A streamed tool call names itself once: its later pieces carry only arguments text.
    oai_chunk.ChoiceDeltaToolCall: {"id", "type"},
    oai_chunk.ChoiceDeltaToolCallFunction: {"name", "arguments"},
    oai.CompletionUsage: {"completion_tokens_details", "prompt_tokens_details"},
    # Of the prompt token details only cached_tokens (and audio_tokens, 0) apply to text models.
    oai_usage.PromptTokensDetails: set(oai_usage.PromptTokensDetails.model_fields) - {"cached_tokens", "audio_tokens"},
    oai.Completion: {"usage"},  # stream chunks without include_usage
}
KINDS: dict[str, type[BaseModel]] = {
    "chat.completion": oai_chat.ChatCompletion,
    "chat.completion.chunk": oai_chat.ChatCompletionChunk,
    "text_completion": oai.Completion,
}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside Optional[...] / list[...] / a union, if any."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def missing_fields(value: Any, model: type[BaseModel], path: str = "") -> list[str]:
    if isinstance(value, list):
        return [m for i, v in enumerate(value) for m in missing_fields(v, model, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    missing = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key not in value:
            if name not in _MAY_BE_ABSENT.get(model, set()):
                missing.append(f"{path}.{key}")
            continue
        inner = _model_in(info.annotation)
        if inner is not None and value[key] is not None:
            missing.extend(missing_fields(value[key], inner, f"{path}.{key}"))
    return missing


def assert_openai_shape(body: dict[str, Any], stream: bool = False) -> BaseModel:
    """Validates body with the SDK's type for its `object` and checks no field is missing."""
    model = KINDS[body["object"]]
    checked = body
    if model is oai.Completion:
        checked = {**body, "choices": [_as_sdk_types_it(c, stream) for c in body["choices"]]}
    parsed = model.model_validate(checked)
    assert not missing_fields(body, model), f"missing fields: {missing_fields(body, model)}"
    assert "usage" not in body or body["usage"] is None or set(body["usage"]) >= {
        "prompt_tokens", "completion_tokens", "total_tokens"}
    return parsed


def _as_sdk_types_it(choice: dict[str, Any], stream: bool) -> dict[str, Any]:
    """Two nulls OpenAI's completions API sends that the SDK's generated types do not allow
    (the SDK builds these objects without validating, so clients never notice): finish_reason
    on stream chunks before a choice ends, and the first echoed prompt token's logprob and
    alternatives (it has none). Only those are substituted; everything else is validated as is."""
    choice = {**choice}
    if stream and choice["finish_reason"] is None:
        choice["finish_reason"] = "stop"
    logprobs = choice.get("logprobs")
    if logprobs is not None:
        choice["logprobs"] = {**logprobs,
                              "token_logprobs": [0.0 if lp is None else lp for lp in logprobs["token_logprobs"]],
                              "top_logprobs": [{} if top is None else top for top in logprobs["top_logprobs"]]}
    return choice


# ---- the responders' bodies ----


def event(text: str, ids: list[int], finish: str | None = None, prompt: PromptLogprobs | None = None
          ) -> GenerationEvent:
    return GenerationEvent(text=text, token_ids=ids, logprobs=[-0.5] * len(ids),
                           top_logprobs=[[(i, -0.5), (65, -1.0)] for i in ids], finish_reason=finish,
                           num_prompt_tokens=2, num_output_tokens=len(ids), prompt_logprobs=prompt)


def as_json(model: BaseModel, with_usage: bool = True) -> dict[str, Any]:
    return json.loads(sse_event(model, with_usage).removeprefix("data: "))


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_completion_and_chunks_are_complete(logprobs: bool) -> None:
    responder = ChatResponder("m", ByteSpeller(), logprobs, include_usage=True, prompt_token_ids=[72, 73])
    outputs = [ChoiceOutput(), ChoiceOutput()]
    outputs[0].add(event("AB", [65, 66], finish="stop"))
    outputs[1].add(event("C", [67], finish="length"))
    full = responder.response(outputs, 2).model_dump()
    parsed = assert_openai_shape(full)
    assert isinstance(parsed, oai_chat.ChatCompletion) and [c.index for c in parsed.choices] == [0, 1]
    assert (full["choices"][0]["logprobs"] is not None) == logprobs
    chunks = [*responder.first_chunks(2), responder.chunk(1, event("x", [120])),
              responder.chunk(0, event("", [], finish="stop")), responder.usage_chunk(usage(2, 3))]
    for chunk in chunks:
        assert_openai_shape(as_json(chunk), stream=True)


def test_chat_chunks_have_no_usage_key_without_include_usage() -> None:
    responder = ChatResponder("m", ByteSpeller(), False, include_usage=False)
    body = as_json(responder.chunk(0, event("a", [97])), with_usage=responder.include_usage)
    assert "usage" not in body
    assert_openai_shape(body, stream=True)
    with_usage = as_json(ChatResponder("m", ByteSpeller(), False, include_usage=True).chunk(0, event("a", [97])))
    assert with_usage["usage"] is None  # OpenAI: null on every chunk but the last


@pytest.mark.parametrize("echo", [False, True])
def test_completion_and_chunks_are_complete(echo: bool) -> None:
    prompt = PromptLogprobs(logprobs=[None, -1.25], top_logprobs=[[], [(73, -1.25), (65, -2.0)]], ranks=[0, 1])
    prompts = [PromptEcho("HI", [72, 73]), PromptEcho("J", [74])]
    responder = CompletionResponder("m", ByteSpeller(), True, prompts, n=1, echo=echo, num_top_logprobs=2,
                                    prompt_logprobs=True)
    outputs = [ChoiceOutput(), ChoiceOutput()]
    outputs[0].add(event("AB", [65, 66], finish="length", prompt=prompt))
    outputs[1].add(event("C", [67], finish="stop", prompt=PromptLogprobs([None], [[]])))
    body = responder.response(outputs, 3).model_dump()
    parsed = assert_openai_shape(body)
    assert isinstance(parsed, oai.Completion)
    first = body["choices"][0]
    if echo:
        assert first["text"] == "HIAB" and body["choices"][1]["text"] == "JC"
        assert first["logprobs"]["tokens"] == ["H", "I", "A", "B"]
        assert first["logprobs"]["token_logprobs"][:2] == [None, -1.25]
        assert first["logprobs"]["top_logprobs"][0] is None and first["logprobs"]["top_logprobs"][1] == {
            "I": -1.25, "A": -2.0}
        assert first["logprobs"]["text_offset"] == [0, 1, 2, 3]
    else:
        assert first["text"] == "AB" and first["logprobs"]["tokens"] == ["A", "B"]
    # vLLM's prompt_logprobs extension: None for the first prompt token, then id -> logprob
    assert first["prompt_logprobs"][0] is None and first["prompt_logprobs"][1]["73"]["logprob"] == -1.25
    assert first["prompt_logprobs"][1]["73"]["rank"] == 1 and first["prompt_logprobs"][1]["65"]["rank"] == 2
    stream = CompletionResponder("m", ByteSpeller(), True, prompts[:1], n=1, echo=echo)
    for chunk in (stream.chunk(0, event("A", [65], prompt=prompt)), stream.chunk(0, event("B", [66], "stop"))):
        body = as_json(chunk, with_usage=False)
        assert "usage" not in body
        assert_openai_shape(body, stream=True)
    assert_openai_shape(as_json(stream.usage_chunk(usage(2, 2))), stream=True)


def test_missing_fields_finds_a_dropped_field() -> None:
    responder = ChatResponder("m", ByteSpeller(), True)
    out = ChoiceOutput()
    out.add(event("A", [65], finish="stop"))
    body = responder.response([out], 2).model_dump()
    del body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    del body["system_fingerprint"]
    assert missing_fields(body, oai_chat.ChatCompletion) == [".choices[0].logprobs.content[0].top_logprobs",
                                                              ".system_fingerprint"]
    assert missing_fields({"index": 0, "text": "x"}, oai_completion_choice.CompletionChoice) == [
        ".finish_reason", ".logprobs"]  # OpenAI sends "logprobs": null, never leaves it out
    assert missing_fields({"message": {"content": None}}, oai_chat_completion.Choice) == [
        ".finish_reason", ".index", ".logprobs", ".message.refusal", ".message.role"]
