"""OpenAI request parameters → the per-request data the workers take (AddRequest, OpenSequence).

app.py builds one GenerationParams per HTTP request from the validated body; the pipeline
turns it into the model worker's AddRequest and the detok worker's OpenSequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gateway.errors import context_length_exceeded, invalid_request
from gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from tokenwire.v1 import common_pb2, detok_worker_pb2, model_worker_pb2

# Enough prompt tokens for the detok worker to decode the first output piece as it reads
# after the prompt (SentencePiece's leading space, a split multi-byte character).
PROMPT_TAIL_LEN = 8
_UINT64 = 1 << 64


@dataclass(frozen=True)
class GenerationParams:
    """What one choice asks of the workers, independent of the OpenAI endpoint it came from."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def for_choice(self, index: int) -> GenerationParams:
        """Params of choice `index` of an n > 1 request: a seeded request gets a distinct seed per
        choice, or every choice would draw the same tokens."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % _UINT64)


def _params(body: ChatCompletionRequest | CompletionRequest, logprobs: bool, top_logprobs: int) -> GenerationParams:
    return GenerationParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=max(body.top_k or 0, 0),
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=None if body.seed is None else body.seed % _UINT64,
        max_tokens=body.completion_token_limit(),
        stop=tuple(body.stop_strings()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def chat_params(body: ChatCompletionRequest) -> GenerationParams:
    return _params(body, body.logprobs, body.top_logprobs or 0)


def completion_params(body: CompletionRequest) -> GenerationParams:
    # Completions' logprobs=N asks for the chosen token's logprob plus the N most likely.
    return _params(body, body.logprobs is not None, body.logprobs or 0)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template expects them; OpenAI's newer 'developer' role is 'system'."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request: text to tokenize, or token ids as given."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    first = prompt[0]
    if isinstance(first, str):
        return first
    if isinstance(first, list):
        return list(first)
    return [t for t in prompt if isinstance(t, int)]


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    if not token_ids:
        raise invalid_request("prompt must contain at least one token", param="prompt")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid_request(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt")


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Refuses here what the model worker would refuse, with OpenAI's wording and both lengths."""
    if num_prompt_tokens >= max_model_len or (
            max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len):
        raise context_length_exceeded(max_model_len, num_prompt_tokens, max_tokens)


def add_request(request_id: str, prompt_token_ids: Sequence[int],
                params: GenerationParams) -> model_worker_pb2.AddRequest:
    sampling = model_worker_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                               top_p=params.top_p)
    if params.seed is not None:
        sampling.seed = params.seed
    return model_worker_pb2.AddRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        max_tokens=params.max_tokens or 0,  # 0: up to the context length
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs if params.logprobs else 0,
    )


def open_sequence(sequence_id: str, tokenizer: common_pb2.TokenizerIdentity,
                  prompt_token_ids: Sequence[int], params: GenerationParams) -> detok_worker_pb2.OpenSequence:
    return detok_worker_pb2.OpenSequence(
        sequence_id=sequence_id,
        tokenizer=tokenizer,
        prompt_tail_ids=list(prompt_token_ids[-PROMPT_TAIL_LEN:]),
        skip_special_tokens=params.skip_special_tokens,
        stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
