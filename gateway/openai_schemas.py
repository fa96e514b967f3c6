"""Pydantic models of the OpenAI chat/completions requests and responses the gateway speaks.

app.py validates request bodies with the request models (unknown fields ignored, known fields
with bad values refused with 400); responses.py fills the response models from pipeline events.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# Fields the OpenAI API defines but tokenwire does not implement yet: refused unless at their
# neutral value, so a client never silently gets something other than what it asked for.
_NOT_SUPPORTED_YET = "is not supported yet"


class _Lenient(BaseModel):
    # The OpenAI SDK sends fields we do not know (user, metadata, store, ...): ignore them.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class TextContentPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _GenerationRequest(_Lenient):
    """Parameters chat completions and completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # Extension (vLLM's): -1 or 0 disable it.
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=16)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names).
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _GenerationRequest:
        if self.presence_penalty != 0.0:
            raise ValueError(f"presence_penalty {_NOT_SUPPORTED_YET}")
        if self.frequency_penalty != 0.0:
            raise ValueError(f"frequency_penalty {_NOT_SUPPORTED_YET}")
        if self.logit_bias:
            raise ValueError(f"logit_bias {_NOT_SUPPORTED_YET}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be >= 0")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.tools:
            raise ValueError(f"tools {_NOT_SUPPORTED_YET}")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} {_NOT_SUPPORTED_YET}")
        return self

    def completion_token_limit(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_GenerationRequest):
    # A string, a batch of one string, token ids, or a batch of one list of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_completion_fields(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if len(self.prompt) == 0:
                raise ValueError("prompt must not be empty")
            if not isinstance(self.prompt[0], int) and len(self.prompt) != 1:
                raise ValueError(f"a batch of {len(self.prompt)} prompts {_NOT_SUPPORTED_YET}; send one prompt")
        if self.echo:
            raise ValueError(f"echo {_NOT_SUPPORTED_YET}")
        if self.suffix:
            raise ValueError(f"suffix {_NOT_SUPPORTED_YET}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of other than n {_NOT_SUPPORTED_YET}")
        return self

    def completion_token_limit(self) -> int | None:
        return self.max_tokens


# ---- responses ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends {"role": "assistant", "content": ""} first, then {"content": ...},
        # and {} with the finish reason: absent keys, not nulls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


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
