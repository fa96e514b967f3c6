"""Unit tests of the gateway's request side: OpenAI body validation and the mapping to proto messages.

No workers involved: these check, for every parameter the gateway takes, what reaches
AddRequest and OpenSequence (request_mapping's pure functions).
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.errors import APIError
from gateway.openai_requests import (
    MAX_BATCH_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    closed_objects,
)
from gateway.request_mapping import (
    PROMPT_TAIL_LEN,
    GenerationParams,
    add_request,
    bad_word_sequences,
    chat_messages_of,
    check_context_length,
    check_params_vocab,
    check_token_ids,
    generation_params,
    open_sequence,
    output_limit,
    truncate_prompt,
)
from tokenwire.v1 import common_pb2, model_worker_pb2

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def encode_words(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character (ord), so the expected ids are obvious."""
    return [ord(c) for c in text]


def add_for(body: ChatCompletionRequest | CompletionRequest) -> model_worker_pb2.AddRequest:
    return add_request("r1", [5, 6, 7], generation_params(body, encode_words))


def test_unknown_fields_are_ignored() -> None:
    body = chat(user="u1", metadata={"a": "b"}, store=False, parallel_tool_calls=True, service_tier="auto")
    assert body.model == "m" and body.user == "u1"


@pytest.mark.parametrize("fields", [
    {"temperature": 2.5}, {"temperature": -0.1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
    {"max_tokens": 0}, {"max_completion_tokens": 0}, {"n": 0}, {"n": 129}, {"top_logprobs": 21, "logprobs": True},
    {"top_logprobs": 2}, {"presence_penalty": 2.5}, {"frequency_penalty": -2.5}, {"logit_bias": {"x": 5}},
    {"logit_bias": {"1": 101}}, {"stop": ""}, {"stop": ["ok", ""]}, {"messages": []},
    {"messages": [{"role": "", "content": "x"}]}, {"tools": []}, {"tool_choice": "auto"},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}}, {"include_reasoning": False},
    {"cache_salt": ""}, {"cache_salt": "s" * 1025}, {"reasoning_effort": "extreme"}, {"truncation_side": "middle"},
    {"documents": "a text"}, {"priority": 1}, {"thinking_token_budget": 100}, {"thinking_token_budget": 0}, {"logprob_token_ids": [1]},
    {"logits_processors": ["m:P"]}, {"repetition_detection": {"min_count": 2}}, {"guided_whitespace_pattern": " "},
    {"kv_transfer_params": {"x": 1}}, {"vllm_xargs": {"a": 1}},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema"}}, {"stream": "sometimes"}, {"stop_token_ids": [-1]},
    # OpenAI's and vLLM's json_schema needs a name (review 103).
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    {"min_p": 1.5}, {"typical_p": 0}, {"repetition_penalty": 0}, {"min_tokens": -1},
    {"min_tokens": 5, "max_tokens": 4}, {"allowed_token_ids": []}, {"allowed_token_ids": [-3]},
    {"bad_words": [""]}, {"bad_words": ["ok", " "]}, {"best_of": 1, "n": 2}, {"prompt_logprobs": -1}, {"guided_choice": []},
    {"guided_regex": "a+", "guided_choice": ["a"]}, {"response_format": {"type": "json_object"}, "regex": "x"},
    {"stream_options": {"include_usage": "maybe"}, "stream": True}, {"stream_options": {"include_usage": True}},
    {"stream_options": {"include_usage": False}},
    {"structured_outputs": {}}, {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"structured_outputs": {"choice": []}}, {"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
    {"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, {"truncate_prompt_tokens": 0},
    {"truncate_prompt_tokens": -2},
])
def test_chat_bad_values_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        chat(**fields)


def test_defaults_map_to_neutral_sampling() -> None:
    add = add_for(chat())
    s = add.sampling
    assert s.temperature == 1.0 and s.top_k == 0 and s.top_p == 1.0 and not s.HasField("seed")
    assert s.min_p == 0 and s.typical_p == 1.0 and s.repetition_penalty == 1.0
    assert s.presence_penalty == 0 and s.frequency_penalty == 0 and not s.logit_bias and not s.bad_words
    assert add.max_tokens == 0  # chat without max_tokens: up to the context length
    assert add.n == 1 and add.best_of == 0 and not add.use_beam_search and not add.HasField("length_penalty")
    assert not add.logprobs and add.top_logprobs == 0 and not add.HasField("prompt_logprobs")
    assert not add.HasField("structured_output")


def test_every_sampling_parameter_reaches_the_add_request() -> None:
    add = add_for(chat(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, typical_p=0.8, seed=-2,
                       presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, min_tokens=2,
                       logit_bias={"11": 5, "12": -100}, bad_words=["ab"], allowed_token_ids=[1, 2, 3],
                       max_tokens=5, max_completion_tokens=7, stop_token_ids=[9], ignore_eos=True))
    s = add.sampling
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9) and s.top_k == 40
    assert s.min_p == pytest.approx(0.05) and s.typical_p == pytest.approx(0.8)
    assert s.seed == (1 << 64) - 2  # proto seed is uint64
    assert not add_for(chat(seed=-1)).sampling.HasField("seed")  # vLLM's "no seed"
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -0.25 and s.repetition_penalty == pytest.approx(1.2)
    assert s.min_tokens == 2 and dict(s.logit_bias) == {11: 5.0, 12: -100.0}
    assert [list(w.token_ids) for w in s.bad_words] == [[97, 98], [32, 97, 98]]
    assert list(s.allowed_token_ids) == [1, 2, 3]
    assert add.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert list(add.stop_token_ids) == [9] and add.ignore_eos
    assert add.request_id == "r1" and list(add.prompt_token_ids) == [5, 6, 7]


def test_requests_with_stop_strings_ask_the_model_worker_to_stream_every_step() -> None:
    """The detok worker finds stop strings; tokens held by the model worker's --stream-interval
    would end such a request steps late. Without stop strings the worker's own interval holds."""
    assert add_for(completion(stop=["\n\n"])).stream_interval == 1
    assert add_for(completion(stop="END")).stream_interval == 1
    assert add_for(completion()).stream_interval == 0
    assert add_for(completion(stop=[])).stream_interval == 0


def test_top_k_minus_one_is_off() -> None:
    assert add_for(chat(top_k=-1)).sampling.top_k == 0


def test_n_best_of_and_beam_search_are_one_request() -> None:
    add = add_for(completion(n=2, best_of=4, use_beam_search=True, length_penalty=0.5, temperature=0))
    assert add.n == 2 and add.best_of == 4 and add.use_beam_search and add.length_penalty == 0.5
    assert add_for(completion(n=2, best_of=4, use_beam_search=True, diversity_penalty=1.5,
                              temperature=0)).diversity_penalty == 1.5


def test_beam_search_without_a_temperature_is_greedy() -> None:
    """A beam search ranks by the model's logprobs, which the model worker takes only unscaled:
    a request that names no temperature gets 0 (the sampler's 1.0 would be refused), one that
    names a temperature keeps it, and the model worker says why it cannot."""
    assert add_for(completion(n=2, use_beam_search=True)).sampling.temperature == 0.0
    assert add_for(chat(n=2, use_beam_search=True)).sampling.temperature == 0.0
    assert add_for(completion(n=2, use_beam_search=True, temperature=0.5)).sampling.temperature == 0.5
    assert add_for(completion(n=2)).sampling.temperature == 1.0


def test_chat_logprobs_and_prompt_logprobs() -> None:
    add = add_for(chat(logprobs=True, top_logprobs=3, prompt_logprobs=2))
    assert add.logprobs and add.top_logprobs == 3 and add.prompt_logprobs == 2
    assert not add_for(chat(logprobs=False)).logprobs


def test_completion_logprobs_int_and_echo() -> None:
    assert generation_params(completion(), encode_words).max_tokens == 16  # OpenAI's completions default
    zero = add_for(completion(logprobs=0))
    assert zero.logprobs and zero.top_logprobs == 0 and not zero.HasField("prompt_logprobs")
    assert add_for(completion(logprobs=5)).top_logprobs == 5
    # echo with logprobs needs the prompt's logprobs, with as many alternatives as the output's
    echoed = add_for(completion(echo=True, logprobs=2))
    assert echoed.prompt_logprobs == 2 and generation_params(completion(echo=True), encode_words).echo
    assert not add_for(completion(echo=True)).HasField("prompt_logprobs")  # echo alone: text only


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     {"json_schema": '{"type": "object"}'}),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": {"type": "integer"}}, {"json_schema": '{"type": "integer"}'}),
    ({"guided_json": '{"type": "string"}'}, {"json_schema": '{"type": "string"}'}),
    ({"guided_regex": "[ab]+"}, {"regex": "[ab]+"}),
    ({"regex": "c+"}, {"regex": "c+"}),
    ({"guided_grammar": "root ::= \"a\""}, {"grammar": "root ::= \"a\""}),
    ({"ebnf": "root ::= \"b\""}, {"grammar": "root ::= \"b\""}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    # vLLM >= 0.12's one field for all of them.
    ({"structured_outputs": {"json": {"type": "integer"}}}, {"json_schema": '{"type": "integer"}'}),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, {"json_schema": '{"type": "string"}'}),
    ({"structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, {"grammar": "root ::= \"a\""}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    # vLLM's disable_additional_properties: objects that list properties take no others.
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {}}}, "disable_additional_properties": True}},
     {"json_schema": '{"type": "object", "properties": {"a": {}}, "additionalProperties": false}'}),
    ({"structured_outputs": {"json": '{"properties": {}}', "disable_additional_properties": True}},
     {"json_schema": '{"properties": {}, "additionalProperties": false}'}),
])
def test_structured_output_mapping(fields: dict[str, object], expected: dict[str, object] | None) -> None:
    for body in (chat(**fields), completion(**fields)):
        add = add_for(body)
        if expected is None:
            assert not add.HasField("structured_output")
            continue
        so = add.structured_output
        (kind, value), = expected.items()
        assert so.WhichOneof("constraint") == kind
        if kind == "choice":
            assert list(so.choice.choices) == value
        elif kind == "json_schema":
            assert json.loads(so.json_schema) == json.loads(str(value))
        else:
            assert getattr(so, kind) == value


def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    # Leading spaces stripped first, as vLLM's: " c" bans "c" at the text's start too, and "  c"
    # banned only the run of two spaces and c (review 100).
    assert bad_word_sequences(["ab", " c", "  c"], encode_words) == [[97, 98], [32, 97, 98], [99], [32, 99]]


def test_messages_keep_tool_roles_and_join_text_parts() -> None:
    body = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "function", "name": "f", "content": "43"},  # the deprecated form of a tool's answer
    ])
    messages = chat_messages_of(body.messages)
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1] == {"role": "user", "content": "a\nb"}  # a line per part, as vLLM joins them
    assert messages[2]["role"] == "assistant" and messages[2]["tool_calls"][0]["id"] == "c1"  # type: ignore[index]
    assert messages[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert messages[4] == {"role": "tool", "content": "43", "name": "f"}


def test_a_replayed_assistant_turn_keeps_its_thinking_for_the_template() -> None:
    # Under either name (reasoning, as this gateway answers; reasoning_content, its older one), the
    # template gets both, as vLLM passes them; only an assistant's turn has any.
    body = chat(messages=[{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "a", "reasoning_content": "I thought"},
                          {"role": "assistant", "content": "b", "reasoning": "then this"},
                          {"role": "user", "content": "q2", "reasoning": "not a turn of thinking"}])
    messages = chat_messages_of(body.messages)
    assert messages[1] == {"role": "assistant", "content": "a", "reasoning": "I thought",
                           "reasoning_content": "I thought"}
    assert messages[2]["reasoning"] == messages[2]["reasoning_content"] == "then this"
    assert messages[3] == {"role": "user", "content": "q2"}


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hello", ["hello"]), (["hello"], ["hello"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]),
    ([[4, 5]], [[4, 5]]), ([[4], [5, 6]], [[4], [5, 6]]),
])
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("fields", [
    {"prompt": []}, {"prompt": [[]]}, {"suffix": "x"}, {"logprobs": 21}, {"logprobs": -1}, {"best_of": 1, "n": 3},
    {"prompt": None}, {"echo": "perhaps"},
])
def test_completion_bad_values_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        completion(**fields)


def test_a_batch_past_the_bound_is_refused_before_its_prompts_are_validated() -> None:
    assert len(completion(prompt=[[5]] * MAX_BATCH_PROMPTS).prompts()) == MAX_BATCH_PROMPTS
    for batch in ([[5]] * (MAX_BATCH_PROMPTS + 1), ["a"] * (MAX_BATCH_PROMPTS + 1)):
        with pytest.raises(ValidationError, match=f"at most {MAX_BATCH_PROMPTS} prompts"):
            completion(prompt=batch)
    # One prompt of token ids is no batch: its length is the context's business.
    assert completion(prompt=[5] * (MAX_BATCH_PROMPTS + 1)).prompts() == [[5] * (MAX_BATCH_PROMPTS + 1)]


def test_open_sequence_carries_prompt_tail_and_stops() -> None:
    identity = common_pb2.TokenizerIdentity(path="/tok", sha256="ab")
    prompt = list(range(20))
    params = generation_params(chat(stop=["a", "bc"], skip_special_tokens=False, include_stop_str_in_output=True),
                               encode_words)
    opened = open_sequence("s1", identity, prompt, params)
    assert opened.sequence_id == "s1" and opened.tokenizer == identity
    assert list(opened.prompt_tail_ids) == prompt[-PROMPT_TAIL_LEN:]
    assert list(opened.stop) == ["a", "bc"]
    assert not opened.skip_special_tokens and opened.include_stop_str_in_output
    assert list(open_sequence("s", identity, prompt, generation_params(chat(stop="x"), encode_words)).stop) == ["x"]


def test_context_length_check_says_both_lengths() -> None:
    check_context_length(10, 6, 16)
    with pytest.raises(APIError) as info:
        check_context_length(10, 7, 16, "prompt")
    assert info.value.status == 400 and info.value.param == "prompt"
    assert "maximum context length is 16 tokens" in info.value.message
    assert "you requested 17 tokens (10 in the prompt, 7 in the completion)" in info.value.message
    with pytest.raises(APIError, match="messages resulted in 16 tokens"):
        check_context_length(16, None, 16)


def test_token_ids_must_be_in_vocab() -> None:
    check_token_ids([0, 99], 100)
    with pytest.raises(APIError, match=r"\[100\]"):
        check_token_ids([1, 100], 100)
    with pytest.raises(APIError):
        check_token_ids([], 100)


@pytest.mark.parametrize(("fields", "param"), [
    ({"logit_bias": {"100": 1}}, "logit_bias"), ({"allowed_token_ids": [5, 100]}, "allowed_token_ids"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),
])
def test_parameter_token_ids_must_be_in_vocab(fields: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as info:
        check_params_vocab(generation_params(chat(**fields), encode_words), 100)
    assert info.value.param == param
    check_params_vocab(GenerationParams(), 100)


def test_tokenize_request_takes_one_input() -> None:
    assert TokenizeRequest.model_validate({"prompt": "x"}).add_special_tokens
    with pytest.raises(ValidationError):
        TokenizeRequest.model_validate({})
    with pytest.raises(ValidationError):
        TokenizeRequest.model_validate({"prompt": "x", "messages": USER})


def test_chat_template_kwargs_may_not_set_apply_chat_template_arguments() -> None:
    """Every named argument of the installed transformers' apply_chat_template is refused as a kwarg."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from gateway.openai_requests import _RESERVED_TEMPLATE_KWARGS

    named = {name for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
             if p.kind is not inspect.Parameter.VAR_KEYWORD and name != "self"}
    assert named <= _RESERVED_TEMPLATE_KWARGS, sorted(named - _RESERVED_TEMPLATE_KWARGS)


@pytest.mark.parametrize(("fields", "param"), [
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": {"name": "f"}}, "function_call"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(fields: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    [error] = info.value.errors()
    assert error["ctx"]["error"].param == param
    if param == "messages":  # one line that says what is wrong, not pydantic's union of content forms
        assert "content parts of type 'image_url' are not supported" in error["msg"]


def test_what_is_accepted_instead_of_refused() -> None:
    # Set to nothing, the same fields are no change; an empty stream_options is let through (vLLM's).
    body = chat(functions=None, function_call=None, audio=None, modalities=["text"], return_tokens_as_token_ids=False,
                stream_options={}, echo=False)
    assert body.stream_options is not None and not body.stream
    # An assistant's refusal part is read as its text; model may be left out (vLLM's).
    refusal = [{"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}, *USER]
    body = ChatCompletionRequest.model_validate({"messages": refusal})
    assert body.model is None and body.messages[0].text() == "I cannot."
    assert CompletionRequest.model_validate({"prompt": "x", "echo": True}).echo  # completions keep echo


def test_vllm_fields_users_bring_along() -> None:
    # Any role the model's template knows (Llama 3's ipython), as vLLM takes it.
    body = chat(messages=[*USER, {"role": "ipython", "content": "42"}])
    assert chat_messages_of(body.messages)[-1] == {"role": "ipython", "content": "42"}
    # stream_options sent at all means usage, unless include_usage says no (vLLM's and SGLang's default).
    assert chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    assert chat(stream=True, stream_options={}).include_usage
    assert not chat(stream=True, stream_options={"include_usage": False}).include_usage
    assert not chat(stream=True).include_usage
    # reasoning_effort reaches the template, and "none" turns thinking off unless the kwargs say otherwise.
    assert chat(reasoning_effort="none").template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}
    assert chat(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False, "x": 1}).template_kwargs() == {
        "reasoning_effort": "high", "enable_thinking": False, "x": 1}
    assert chat(chat_template_kwargs={"x": 1}).template_kwargs() == {"x": 1}
    # The tool checks leave "none" without tools alone (OpenAI's and vLLM's).
    assert chat(tool_choice="none").tool_choice == "none"
    assert add_for(completion(cache_salt="tenant-a")).cache_salt == "tenant-a"
    assert add_for(completion()).cache_salt == ""


@pytest.mark.parametrize("side, kept", [(None, [4, 5, 6]), ("left", [4, 5, 6]), ("right", [1, 2, 3])])
def test_truncation_side_picks_the_end_kept(side, kept) -> None:
    assert truncate_prompt([1, 2, 3, 4, 5, 6], 3, 100, 10, side) == kept
    assert truncate_prompt([1, 2], 3, 100, 10, side) == [1, 2]


def test_two_output_constraints_name_the_second() -> None:
    with pytest.raises(ValidationError) as info:
        chat(guided_regex="a+", structured_outputs={"choice": ["a"]})
    [error] = info.value.errors()
    assert error["ctx"]["error"].param == "structured_outputs"


def test_the_generation_refusals_leave_tokenize_alone() -> None:
    from gateway.openai_requests import TokenizeRequest

    body = TokenizeRequest.model_validate({"prompt": "hi", "echo": True, "functions": [{"name": "f"}]})
    assert body.prompt == "hi"


def test_tokenize_refuses_a_request_chat_template_as_chat_does() -> None:
    # The count would be for the model's own template, not the one sent.
    with pytest.raises(ValidationError) as info:
        TokenizeRequest.model_validate({"messages": USER, "chat_template": "{{ messages[0].content }}"})
    [error] = info.value.errors()
    assert error["ctx"]["error"].param == "chat_template"
    # A plain prompt ignores the template fields, this one too; a chat body's stray prompt key does not.
    assert TokenizeRequest.model_validate({"prompt": "hi", "chat_template": "{{ x }}"}).prompt == "hi"
    with pytest.raises(ValidationError):
        chat(chat_template="{{ 'X' }}", prompt="anything")


def test_a_model_worker_refusal_of_a_sampling_field_names_the_bodys_parameter() -> None:
    from gateway.request_mapping import params_of_fields

    params = params_of_fields(completion(prompt="a", use_beam_search=True, best_of=2))
    assert params["sampling.temperature"] == "temperature" and params["sampling.logit_bias"] == "logit_bias"
    assert params["prompt_logprobs"] == "prompt_logprobs" and params["best_of"] == "best_of"
    assert "sampling.mirostat" not in params  # not a field of the body: the error keeps param null


def test_tool_choice_none_shows_the_tools_unless_the_gateway_excludes_them() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = chat(tools=[tool], tool_choice="none")
    assert [t["function"]["name"] for t in body.template_tools()] == ["f"]  # OpenAI's and vLLM's default
    assert body.template_tools(exclude_when_none=True) is None  # --exclude-tools-when-tool-choice-none
    assert chat(tools=[tool], tool_choice="auto").template_tools(exclude_when_none=True) is not None


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_forced_call_without_a_type_decodes_an_object() -> None:
    """parameters with properties but no "type" (valid JSON Schema, and accepted as an object)
    match any JSON value as sent: the decoded arguments could be `true` or a list."""
    import jsonschema

    untyped = _tool("e", {"properties": {"a": {"type": "integer"}}, "required": ["a"]})
    named = chat(tools=[untyped], tool_choice={"type": "function", "function": {"name": "e"}}).tool_call_schema()
    required = chat(tools=[untyped], tool_choice="required").tool_call_schema()
    for arguments in (True, [{}], ":"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(arguments, named)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "e", "parameters": arguments}], required)
    jsonschema.validate({"a": 1}, named)
    jsonschema.validate([{"name": "e", "parameters": {"a": 1}}], required)


def test_closed_objects_follow_vllms_disable_additional_properties() -> None:
    """Objects that list properties (or patternProperties) and say nothing of others take no
    others, at any depth; what the schema says itself, data (enum, const, default) and the maps of
    names (a property named "properties") are left as sent."""
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"z": {}}}},
        "either": {"anyOf": [{"properties": {"p": {}}}, {"type": "string"}]},
        "pattern": {"patternProperties": {"^a": {}}},
        "data": {"const": {"properties": {}}, "default": {"properties": {}}}},
        "$defs": {"d": {"properties": {"q": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    inner = closed["properties"]
    assert "additionalProperties" not in inner  # the map of names, not a schema
    assert inner["properties"]["additionalProperties"] is False
    assert inner["open"]["additionalProperties"] is True
    assert inner["list"]["items"]["additionalProperties"] is False
    assert inner["either"]["anyOf"][0]["additionalProperties"] is False and inner["either"]["anyOf"][1] == {
        "type": "string"}
    assert inner["pattern"]["additionalProperties"] is False
    assert inner["data"] == {"const": {"properties": {}}, "default": {"properties": {}}}
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not changed
    # Composed objects stay as sent: closed, a base and its extension would refuse each other's keys.
    composed = {"type": "object", "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"city": {"type": "string"}},
                "required": ["city", "id"], "$defs": {"Base": {"type": "object", "properties": {"id": {}}}}}
    assert closed_objects(composed) == composed
    beside = {"type": "object", "properties": {"a": {"$ref": "#/$defs/B", "properties": {"c": {}}}},
              "$defs": {"B": {"properties": {"b": {}}}}}
    assert closed_objects(beside) == beside
    # An allOf of one schema, nothing beside it (a $ref carrying a description), composes nothing.
    wrapper = closed_objects({"type": "object", "properties": {"when": {"allOf": [{"$ref": "#/$defs/Date"}],
                                                                       "description": "d"}},
                              "$defs": {"Date": {"type": "object", "properties": {"y": {}}}}})
    assert wrapper["additionalProperties"] is False and wrapper["$defs"]["Date"]["additionalProperties"] is False
    # A property named allOf is a name, not composition.
    named = closed_objects({"type": "object", "properties": {"allOf": {"type": "string"}}})
    assert named["additionalProperties"] is False


def test_a_schema_nested_past_pythons_stack_is_a_400() -> None:
    """A RecursionError in the mapping (json.dumps) answered 500 (review 105), and in a forced
    tool call's schema, built while the body is validated (review 107)."""
    deep: dict = {"type": "object"}
    for _ in range(2000):
        deep = {"type": "object", "properties": {"a": deep}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(ValidationError, match="nested too deeply"):
            chat(tools=tools, tool_choice=tool_choice)
    # 250 levels, which json.loads and the mapping take, are served (the composition check walked
    # them on the stack and failed from 200).
    served: dict = {"type": "object"}
    for _ in range(250):
        served = {"type": "object", "properties": {"a": served}}
    assert chat(tools=[{"type": "function", "function": {"name": "f", "parameters": served}}],
                tool_choice="required").tool_call_schema() is not None
    for fields, param in (({"structured_outputs": {"json": deep}}, "structured_outputs"),
                          ({"guided_json": deep}, "guided_json")):
        with pytest.raises(APIError) as info:
            add_for(chat(**fields))
        assert (info.value.status, info.value.param) == (400, param)
        assert "nested too deeply" in info.value.message


def test_forced_calls_take_only_the_declared_keys() -> None:
    """A forced call decodes as vLLM's default backend (xgrammar, strict) decodes it: no key its
    function does not list, none beside name and parameters in a "required" list's entries, and {}
    for a function without parameters; 7 of 16 "required" samples of a tiny model wandered into
    extra keys and lost every call (review 103)."""
    import jsonschema

    city = _tool("weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    now = {"type": "function", "function": {"name": "now"}}
    named = chat(tools=[city, now], tool_choice={"type": "function", "function": {"name": "weather"}}).tool_call_schema()
    jsonschema.validate({"city": "Paris"}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "country": "France"}, named)
    bare = chat(tools=[city, now], tool_choice={"type": "function", "function": {"name": "now"}}).tool_call_schema()
    jsonschema.validate({}, bare)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"weather": "fine"}, bare)
    required = chat(tools=[city, now], tool_choice="required").tool_call_schema()
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}],
                        required)
    for bad in ({"name": "now", "parameters": {}, "": ","}, {"name": "weather", "parameters": {"city": "a", "b": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], required)


def test_the_required_call_list_keeps_each_tools_own_pointers() -> None:
    """Nested in the call list, each tool's local $refs still mean its own schema: "#" (a tree),
    draft-07 "#/definitions/...", a "#/properties/..." pointer (zod's refs), and $defs of the same
    name in two tools, each its own."""
    import jsonschema

    tree = _tool("tree", {"type": "object", "properties": {"label": {"type": "string"},
                                                           "children": {"type": "array", "items": {"$ref": "#"}}},
                          "required": ["label"]})
    draft7 = _tool("unit", {"type": "object", "definitions": {"U": {"type": "string", "enum": ["c", "f"]}},
                            "properties": {"u": {"$ref": "#/definitions/U"}}, "required": ["u"]})
    zod = _tool("route", {"type": "object", "properties": {"from": {"type": "string"},
                                                          "to": {"$ref": "#/properties/from"}}, "required": ["to"]})
    ints = _tool("count", {"type": "object", "$defs": {"U": {"type": "integer"}},
                           "properties": {"u": {"$ref": "#/$defs/U"}}, "required": ["u"],
                           "enum_holder": {"const": {"$ref": "#"}}})
    strs = _tool("word", {"type": "object", "$defs": {"U": {"type": "string"}},
                          "properties": {"u": {"$ref": "#/$defs/U"}}, "required": ["u"]})
    schema = chat(tools=[tree, draft7, zod, ints, strs], tool_choice="required").tool_call_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "tree", "parameters": {"label": "a", "children": [{"label": "b", "children": []}]}},
            {"name": "unit", "parameters": {"u": "c"}}, {"name": "route", "parameters": {"to": "x"}},
            {"name": "count", "parameters": {"u": 3}}, {"name": "word", "parameters": {"u": "three"}}]
    jsonschema.validate(good, schema)
    for bad in ({"name": "tree", "parameters": {"label": "a", "children": [{"children": []}]}},
                {"name": "unit", "parameters": {"u": "k"}}, {"name": "route", "parameters": {"to": 1}},
                {"name": "count", "parameters": {"u": "3"}}, {"name": "word", "parameters": {"u": 3}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    # Data is left as sent: a "$ref" inside a const is a value, not a pointer.
    assert schema["$defs"]["tokenwire_tool_3"]["enum_holder"] == {"const": {"$ref": "#"}}


def test_unset_sampling_fields_take_the_models_defaults() -> None:
    """vLLM's --generation-config auto: what the body leaves unset comes from the model's
    generation_config.json (ModelInfo.generation_defaults), what it sets stays; max_new_tokens
    bounds max_tokens; a beam search takes none of them (its knobs would be refused)."""
    defaults = model_worker_pb2.GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                                                   max_new_tokens=64)
    unset = generation_params(chat(), _no_words, defaults)
    s = unset.sampling
    assert (round(s.temperature, 4), round(s.top_p, 4), s.top_k, round(s.repetition_penalty, 4), s.min_p) == (
        0.7, 0.8, 20, 1.05, 0.0)
    assert (unset.max_tokens, output_limit(unset)) == (None, 64)
    mine = generation_params(chat(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0, min_p=0.1,
                                  max_tokens=100), _no_words, defaults)
    s = mine.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, round(s.min_p, 4)) == (0.0, 1.0, 0, 1.0, 0.1)
    # The least of the two bounds the output, as vLLM takes it; the body's own is what the context checks.
    assert (mine.max_tokens, output_limit(mine)) == (100, 64)
    assert output_limit(generation_params(chat(max_tokens=8), _no_words, defaults)) == 8
    beams = generation_params(chat(use_beam_search=True, n=2), _no_words, defaults)
    assert (beams.sampling.temperature, beams.sampling.top_p, beams.sampling.top_k) == (0.0, 1.0, 0)
    plain = generation_params(chat(), _no_words, model_worker_pb2.GenerationDefaults())
    assert (plain.sampling.temperature, plain.sampling.top_p, output_limit(plain)) == (1.0, 1.0, None)


def _no_words(text: str) -> list[int]:
    return []


def test_the_models_defaults_are_what_vllm_reads_from_generation_config() -> None:
    from model_worker.__main__ import generation_defaults

    qwen = generation_defaults({"bos_token_id": 1, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                "repetition_penalty": 1.05, "max_new_tokens": 2048})
    assert set(f.name for f, _ in qwen.ListFields()) == {"temperature", "top_p", "top_k", "repetition_penalty",
                                                         "max_new_tokens"}
    # transformers' own defaults are not in the file's to_diff_dict(), so vLLM leaves them out too.
    assert not generation_defaults({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "do_sample": True}).ListFields()
    assert not generation_defaults({"temperature": "0.7", "top_k": True}).ListFields()  # not numbers
    assert generation_defaults({"temperature": 0}).temperature == 0.0 and generation_defaults(
        {"temperature": 0}).HasField("temperature")
