"""Pydantic models of the OpenAI chat/completions responses, stream chunks, models list and errors.

responses.py fills them from pipeline events; app.py names them in the OpenAPI document, so
the document says what the gateway really returns.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, model_serializer


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose KV the model worker's prefix cache already held (OpenAI's field).
    cached_tokens: int
    # OpenAI sends it on text models too, as 0; these models take no audio.
    audio_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class VllmLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# Per prompt token: None for the first, else token id -> its logprob (vLLM's extension field).
PromptLogprobsField = list[dict[str, VllmLogprob] | None] | None


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's thinking (--reasoning-parser): vLLM's `reasoning`, and `reasoning_content`,
    # its earlier name, which clients still read.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _no_keys_without_values(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("tool_calls", "reasoning", "reasoning_content"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


# vLLM's stop_reason: the stop string or stop_token_ids entry that ended a choice (null otherwise).
StopReason = int | str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: StopReason = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsField = None


class _WithoutNulls(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # Stream deltas carry only the keys they set: absent keys, not nulls (OpenAI's).
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """A piece of a streamed tool call: its id, type and name on the first, arguments text after."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # and reasoning_content, as on AssistantMessage
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends {"role": "assistant", "content": ""} first, then {"content": ...},
        # and {} with the finish reason: absent keys, not nulls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a chat stream. `usage` is present (null, then the totals on the last
    chunk) only when the client set stream_options.include_usage, as OpenAI does."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # With echo, the first prompt token has no logprob and no alternatives: null.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobsField = None


class Completion(BaseModel):
    """Both the non-stream response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenwire"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
