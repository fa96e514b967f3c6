"""Unit tests of the gateway's request side: OpenAI body validation and the mapping to proto messages.

No workers involved: these check what reaches AddRequest and OpenSequence for a given body.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.errors import APIError
from gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from gateway.request_mapping import (
    PROMPT_TAIL_LEN,
    GenerationParams,
    add_request,
    chat_messages,
    chat_params,
    check_context_length,
    check_token_ids,
    completion_params,
    completion_prompt,
    open_sequence,
)
from tokenwire.v1 import common_pb2

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def test_unknown_fields_are_ignored() -> None:
    body = chat(user="u1", metadata={"a": "b"}, store=False, parallel_tool_calls=True)
    assert body.model == "m"


@pytest.mark.parametrize("fields", [
    {"temperature": 2.5}, {"temperature": -0.1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
    {"max_tokens": 0}, {"max_completion_tokens": 0}, {"n": 0}, {"top_logprobs": 21, "logprobs": True},
    {"top_logprobs": 2}, {"presence_penalty": 0.5}, {"frequency_penalty": -1.0}, {"logit_bias": {"1": 5}},
    {"stop": ""}, {"stop": ["ok", ""]}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"response_format": {"type": "json_object"}},
    {"stream": "sometimes"}, {"stop_token_ids": [-1]},
])
def test_chat_bad_values_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        chat(**fields)


def test_penalty_refusal_says_not_supported_yet() -> None:
    with pytest.raises(ValidationError, match="presence_penalty is not supported yet"):
        chat(presence_penalty=1.0)


def test_chat_defaults_map_to_sampling_at_temperature_one() -> None:
    params = chat_params(chat())
    assert params == GenerationParams(temperature=1.0, top_k=0, top_p=1.0, seed=None, max_tokens=None)


def test_chat_params_mapping() -> None:
    params = chat_params(chat(temperature=0, top_k=-1, top_p=0.9, seed=-1, max_tokens=5, max_completion_tokens=7,
                              stop="END", stop_token_ids=[7], ignore_eos=True, skip_special_tokens=False,
                              include_stop_str_in_output=True, logprobs=True, top_logprobs=3))
    assert params.temperature == 0.0 and params.top_k == 0 and params.top_p == 0.9
    assert params.seed == (1 << 64) - 1  # proto seed is uint64
    assert params.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert params.stop == ("END",) and params.stop_token_ids == (7,)
    assert params.ignore_eos and not params.skip_special_tokens and params.include_stop_str_in_output
    assert params.logprobs and params.top_logprobs == 3


def test_chat_messages_join_text_parts_and_map_developer_to_system() -> None:
    body = chat(messages=[{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert chat_messages(body) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5]),
])
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    assert completion_prompt(completion(prompt=prompt)) == expected


@pytest.mark.parametrize("fields", [
    {"prompt": ["a", "b"]}, {"prompt": []}, {"prompt": [[1], [2]]}, {"echo": True}, {"suffix": "x"},
    {"logprobs": 6}, {"logprobs": -1}, {"best_of": 3}, {"prompt": None},
])
def test_completion_bad_values_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        completion(**fields)


def test_completion_defaults_and_logprobs() -> None:
    assert completion_params(completion()).max_tokens == 16  # OpenAI's completions default
    assert not completion_params(completion()).logprobs
    zero = completion_params(completion(logprobs=0))
    assert zero.logprobs and zero.top_logprobs == 0
    assert completion_params(completion(logprobs=5)).top_logprobs == 5


def test_add_request_carries_every_parameter() -> None:
    params = GenerationParams(temperature=0.5, top_k=4, top_p=0.8, seed=11, max_tokens=9, stop_token_ids=(3,),
                              ignore_eos=True, logprobs=True, top_logprobs=2)
    add = add_request("r1", [5, 6, 7], params)
    assert add.request_id == "r1" and list(add.prompt_token_ids) == [5, 6, 7]
    assert add.sampling.temperature == 0.5 and add.sampling.top_k == 4
    assert add.sampling.top_p == pytest.approx(0.8) and add.sampling.seed == 11
    assert add.max_tokens == 9 and list(add.stop_token_ids) == [3] and add.ignore_eos
    assert add.logprobs and add.top_logprobs == 2


def test_add_request_unseeded_and_unbounded() -> None:
    add = add_request("r", [1], GenerationParams())
    assert not add.sampling.HasField("seed")
    assert add.max_tokens == 0  # up to the context length
    assert add.top_logprobs == 0 and not add.logprobs


def test_open_sequence_carries_prompt_tail_and_stops() -> None:
    identity = common_pb2.TokenizerIdentity(path="/tok", sha256="ab")
    prompt = list(range(20))
    params = GenerationParams(stop=("a", "bc"), skip_special_tokens=False, include_stop_str_in_output=True)
    opened = open_sequence("s1", identity, prompt, params)
    assert opened.sequence_id == "s1" and opened.tokenizer == identity
    assert list(opened.prompt_tail_ids) == prompt[-PROMPT_TAIL_LEN:]
    assert list(opened.stop) == ["a", "bc"]
    assert not opened.skip_special_tokens and opened.include_stop_str_in_output


def test_for_choice_spreads_seeds() -> None:
    params = GenerationParams(seed=5)
    assert [params.for_choice(i).seed for i in range(3)] == [5, 6, 7]
    assert GenerationParams().for_choice(2).seed is None


def test_context_length_check_says_both_lengths() -> None:
    check_context_length(10, 6, 16)
    with pytest.raises(APIError) as info:
        check_context_length(10, 7, 16)
    assert info.value.status == 400
    assert "maximum context length is 16 tokens" in info.value.message
    assert "you requested 17 tokens (10 in the messages, 7 in the completion)" in info.value.message
    with pytest.raises(APIError, match="resulted in 16 tokens"):
        check_context_length(16, None, 16)


def test_token_ids_must_be_in_vocab() -> None:
    check_token_ids([0, 99], 100)
    with pytest.raises(APIError, match=r"\[100\]"):
        check_token_ids([1, 100], 100)
    with pytest.raises(APIError):
        check_token_ids([], 100)
