"""OpenAI request parameters → the per-request data the workers take (AddRequest, OpenSequence).

app.py builds one GenerationParams per prompt from the validated body (generation_params); the
pipeline turns it into the model worker's AddRequest and one detok OpenSequence per choice.
Everything here is pure: a body and a tokenizer function in, proto messages out.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import context_length_exceeded, invalid_request
from gateway.openai_requests import ChatCompletionRequest, ChatMessage, CompletionRequest, closed_objects
from gateway.tool_parsers import strict_json
from tokenwire.v1 import common_pb2, detok_worker_pb2, model_worker_pb2

# Enough prompt tokens for the detok worker to decode the first output piece as it reads
# after the prompt (SentencePiece's leading space, a split multi-byte character).
PROMPT_TAIL_LEN = 8
_UINT64 = 1 << 64

GenerationRequest = ChatCompletionRequest | CompletionRequest
# Text → token ids without special tokens (BOS), for bad_words.
EncodeWords = Callable[[str], list[int]]


@dataclass(frozen=True)
class GenerationParams:
    """What one prompt asks of the workers, independent of the OpenAI endpoint it came from."""

    sampling: model_worker_pb2.SamplingParams = field(default_factory=model_worker_pb2.SamplingParams)
    # The body's own output limit (None: up to the context), which a prompt must leave room for.
    max_tokens: int | None = None
    # generation_config.json's max_new_tokens (None: none): the least of the two bounds the output
    # (output_limit); where the body set none, it is cut to each prompt's room left in the context
    # (fitted_to), never a reason to refuse (vLLM's rule).
    model_max_tokens: int | None = None
    n: int = 1
    # 0: same as n. More: candidates generated, the n best returned at the end.
    best_of: int = 0
    use_beam_search: bool = False
    length_penalty: float | None = None
    diversity_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # None: no prompt logprobs; k: each prompt token's logprob plus k alternatives.
    prompt_logprobs: int | None = None
    structured_output: model_worker_pb2.StructuredOutput | None = None
    # Completions only: the prompt's text (and logprobs) lead each choice's output.
    echo: bool = False
    # vLLM's cache_salt: prefix-cache blocks are shared only with requests of the same salt.
    cache_salt: str = ""
    # The request's own parameter for an AddRequest field the model worker names in a refusal
    # (RequestError.field): the 400's `param`.
    params_of_fields: dict[str, str] = field(default_factory=dict)


def sampling_params(body: GenerationRequest, encode_words: EncodeWords,
                    defaults: model_worker_pb2.GenerationDefaults | None = None) -> model_worker_pb2.SamplingParams:
    """The sampler's settings, each OpenAI / vLLM field to its proto field of the same meaning;
    a field the body leaves unset takes the model's default (its generation_config.json, as
    vLLM's --generation-config auto), else the API's. A beam search takes none of the model's:
    it runs on the model's own logprobs, greedy unless a temperature was asked for."""
    if body.use_beam_search or defaults is None:
        defaults = model_worker_pb2.GenerationDefaults()

    def unset(value: float | int | None, name: str, api_default: float | int) -> float | int:
        if value is not None:
            return value
        return getattr(defaults, name) if defaults.HasField(name) else api_default

    sampling = model_worker_pb2.SamplingParams(
        temperature=unset(body.temperature, "temperature", 0.0 if body.use_beam_search else 1.0),
        top_k=max(unset(body.top_k, "top_k", 0), 0),  # vLLM's -1 and 0 both mean off
        top_p=unset(body.top_p, "top_p", 1.0),
        min_p=unset(body.min_p, "min_p", 0.0),
        typical_p=body.typical_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=unset(body.repetition_penalty, "repetition_penalty", 1.0),
        min_tokens=body.min_tokens,
        allowed_token_ids=body.allowed_token_ids or (),
    )
    if body.seed is not None and body.seed != -1:  # -1: no seed, as vLLM's (clients send it for "random")
        sampling.seed = body.seed % _UINT64  # proto seed is uint64; OpenAI's may be negative
    for token_id, bias in (body.logit_bias or {}).items():
        sampling.logit_bias[int(token_id)] = bias
    for ids in bad_word_sequences(body.bad_words or (), encode_words):
        sampling.bad_words.add(token_ids=ids)
    return sampling


def bad_word_sequences(words: Sequence[str], encode_words: EncodeWords) -> list[list[int]]:
    """Each bad word, its leading spaces stripped, as token ids alone and after a space (vLLM's
    rule: in BPE vocabularies " word" at a word boundary is a different token run from "word")."""
    sequences: list[list[int]] = []
    for word in words:
        word = word.lstrip()  # the request refuses one of only spaces
        for variant in (word, " " + word):
            ids = encode_words(variant)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def structured_output(body: GenerationRequest) -> model_worker_pb2.StructuredOutput | None:
    """The one output constraint the body names (the request models refuse two), or None."""
    try:
        return _structured_output(body)
    except RecursionError:  # a schema nested deeper than Python's stack, in json.dumps or closed_objects: not a 500
        field = next((name for name in ("structured_outputs", "response_format", "guided_json")
                      if getattr(body, name, None) is not None), "tools")
        raise invalid_request("the JSON schema is nested too deeply", param=field) from None


def _structured_output(body: GenerationRequest) -> model_worker_pb2.StructuredOutput | None:
    so = model_worker_pb2.StructuredOutput
    tool_schema = body.tool_call_schema() if isinstance(body, ChatCompletionRequest) else None
    if tool_schema is not None:
        return so(json_schema=json.dumps(tool_schema))
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        return so(json_object=True)
    if fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None, "validated by ResponseFormat"
        return so(json_schema=json.dumps(fmt.json_schema.schema_))
    if body.guided_json is not None:
        schema = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        return so(json_schema=schema)
    if body.guided_regex is not None or body.regex is not None:
        return so(regex=body.guided_regex if body.guided_regex is not None else body.regex)
    if body.guided_grammar is not None or body.ebnf is not None:
        return so(grammar=body.guided_grammar if body.guided_grammar is not None else body.ebnf)
    if body.guided_choice is not None:
        return so(choice=so.Choice(choices=body.guided_choice))
    outputs = body.structured_outputs
    if outputs is not None:
        if outputs.json_ is not None:
            schema = outputs.json_
            if outputs.disable_additional_properties:
                try:
                    schema = closed_objects(json.loads(schema) if isinstance(schema, str) else schema)
                except json.JSONDecodeError:
                    pass  # the model worker's compile says what is wrong with it
            return so(json_schema=schema if isinstance(schema, str) else json.dumps(schema))
        if outputs.regex is not None:
            return so(regex=outputs.regex)
        if outputs.grammar is not None:
            return so(grammar=outputs.grammar)
        if outputs.choice is not None:
            return so(choice=so.Choice(choices=outputs.choice))
        return so(json_object=True)
    return None


def generation_params(body: GenerationRequest, encode_words: EncodeWords,
                      defaults: model_worker_pb2.GenerationDefaults | None = None) -> GenerationParams:
    """defaults: the model's sampling defaults (ModelInfo.generation_defaults)."""
    if isinstance(body, ChatCompletionRequest):
        logprobs, top_logprobs, echo = body.logprobs, body.top_logprobs or 0, False
    else:
        # Completions' logprobs=N asks for the chosen token's logprob plus the N most likely.
        logprobs, top_logprobs, echo = body.logprobs is not None, body.logprobs or 0, body.echo
    prompt_logprobs = body.prompt_logprobs
    if echo and logprobs:
        # Echoed prompt tokens carry logprobs too, with as many alternatives as the output's.
        prompt_logprobs = max(prompt_logprobs or 0, top_logprobs)
    model_max_tokens = defaults.max_new_tokens if defaults is not None and defaults.HasField("max_new_tokens") \
        else None
    return GenerationParams(
        sampling=sampling_params(body, encode_words, defaults),
        max_tokens=body.completion_token_limit(),
        model_max_tokens=model_max_tokens,
        n=body.n,
        best_of=body.best_of or 0,
        use_beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
        diversity_penalty=body.diversity_penalty,
        stop=tuple(body.stop_strings()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_output=structured_output(body),
        echo=echo,
        cache_salt=body.cache_salt or "",
        params_of_fields=params_of_fields(body),
    )


_SAMPLING_FIELDS = tuple(model_worker_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def params_of_fields(body: GenerationRequest) -> dict[str, str]:
    """The body's parameter behind each AddRequest field a model worker refusal can name."""
    forced_call = isinstance(body, ChatCompletionRequest) and body.forces_tool_call()
    constraint = "tool_choice" if forced_call else next(iter(body.output_constraints()), "")
    params = {"best_of": "best_of" if body.best_of is not None else "n", "n": "n",
              "diversity_penalty": "diversity_penalty", "length_penalty": "length_penalty",
              "prompt_logprobs": "prompt_logprobs",
              "top_logprobs": "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"}
    # SamplingParams fields the body sets under the same name (temperature, top_k, logit_bias...).
    params.update({f"sampling.{name}": name for name in _SAMPLING_FIELDS if name in type(body).model_fields})
    if constraint:
        params["structured_output"] = constraint
    return params


def chat_messages_of(chat: Sequence[ChatMessage]) -> list[dict[str, object]]:
    """Messages as chat templates expect them; OpenAI's newer 'developer' role is 'system', and its
    deprecated 'function' (a function's result) is 'tool', the role templates know for one."""
    messages: list[dict[str, object]] = []
    for m in chat:
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        message: dict[str, object] = {"role": role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_call_for_template(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if role == "assistant" and reasoning is not None:
            # Both names, as vLLM passes them: templates read one or the other.
            message["reasoning"] = message["reasoning_content"] = reasoning
        messages.append(message)
    return messages


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """A replayed assistant tool call with its arguments as an object: the API sends them as JSON
    text, templates (Qwen2.5's, Hermes', Llama's) render them as a dict (vLLM parses them too)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    text = function["arguments"]
    try:
        arguments = strict_json(text) if text.strip() else {}
    except ValueError as exc:
        raise invalid_request(f"a tool call's arguments are not JSON: {exc}", param="messages") from exc
    return {**call, "function": {**function, "arguments": arguments}}


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    if not token_ids and param == "prompt":
        raise invalid_request("prompt must contain at least one token", param=param)
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid_request(f"{param} token ids must be in [0, {vocab_size}); got {bad[:5]}", param=param)


def check_params_vocab(params: GenerationParams, vocab_size: int) -> None:
    """Token ids in parameters must exist in the vocabulary, like prompt ids."""
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(list(params.sampling.logit_bias), vocab_size, "logit_bias")
    check_token_ids(params.sampling.allowed_token_ids, vocab_size, "allowed_token_ids")


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int, max_tokens: int | None,
                    side: str | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens, so a long input is cut rather
    than refused. -1: as many as leave room for max_tokens (at least one) in the context (vLLM keeps
    max_model_len, which leaves none and is refused then). side "right" (vLLM's truncation_side):
    the first `keep` tokens instead."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise invalid_request(f"truncate_prompt_tokens ({keep}) must be <= the model's maximum context length "
                              f"({max_model_len})", param="truncate_prompt_tokens")
    if keep == -1:
        keep = max_model_len - (max_tokens or 1)
        if keep < 1:  # no room whatever the cut: the refusal then counts the prompt as sent
            return ids
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]


def fitted_to(params: GenerationParams, num_prompt_tokens: int, max_model_len: int) -> GenerationParams:
    """params for one prompt: the model's default output length cut to the room the prompt leaves
    (a default of 256 with 31 prompt tokens in a 128-token context: 97, not a 400)."""
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is None and params.model_max_tokens is not None and params.model_max_tokens > room > 0:
        return dataclasses.replace(params, model_max_tokens=room)
    return params


def output_limit(params: GenerationParams) -> int | None:
    """The most tokens an output may have (None: up to the context): vLLM's least of the request's
    and the model's (and the context's, which the model worker applies)."""
    limits = [n for n in (params.max_tokens, params.model_max_tokens) if n is not None]
    return min(limits) if limits else None


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         param: str = "messages") -> None:
    """Refuses here what the model worker would refuse, with OpenAI's wording and both lengths."""
    if num_prompt_tokens >= max_model_len or (
            max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len):
        raise context_length_exceeded(max_model_len, num_prompt_tokens, max_tokens, param)


def add_request(request_id: str, prompt_token_ids: Sequence[int],
                params: GenerationParams) -> model_worker_pb2.AddRequest:
    add = model_worker_pb2.AddRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=params.sampling,
        max_tokens=output_limit(params) or 0,  # 0: up to the context length
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs if params.logprobs else 0,
        n=params.n,
        best_of=params.best_of,
        use_beam_search=params.use_beam_search,
        diversity_penalty=params.diversity_penalty,
        # Stop strings are matched in the detok worker, and the request is aborted once one is
        # read: tokens held for the model worker's --stream-interval would end it that much later.
        stream_interval=1 if params.stop else 0,
        cache_salt=params.cache_salt,
    )
    if params.prompt_logprobs is not None:
        add.prompt_logprobs = params.prompt_logprobs
    if params.length_penalty is not None:
        add.length_penalty = params.length_penalty
    if params.structured_output is not None:
        add.structured_output.CopyFrom(params.structured_output)
    return add


def open_sequence(sequence_id: str, tokenizer: common_pb2.TokenizerIdentity,
                  prompt_token_ids: Sequence[int], params: GenerationParams) -> detok_worker_pb2.OpenSequence:
    return detok_worker_pb2.OpenSequence(
        sequence_id=sequence_id,
        tokenizer=tokenizer,
        prompt_tail_ids=list(prompt_token_ids[-PROMPT_TAIL_LEN:]),
        skip_special_tokens=params.skip_special_tokens,
        stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.sampling.min_tokens if params.stop else 0,
    )
