"""Pipeline events → OpenAI response bodies and SSE chunks, for chat completions and completions.

app.py hands each choice's GenerationEvents to a ChatResponder or CompletionResponder, which
build the exact JSON objects the OpenAI SDK parses; sse_event frames them for a stream.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from gateway.errors import APIError, error_sse_event
from gateway.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from gateway.request_state import GenerationEvent

logger = logging.getLogger(__name__)

SYSTEM_FINGERPRINT = "tokenwire-0.1.0"
SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: a `data:` line of JSON and the blank line that ends the event."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


class TokenSpeller(Protocol):
    """What rendering logprobs needs of a tokenizer (PromptTokenizer is one)."""

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass
class ChoiceOutput:
    """Everything one choice has produced, gathered for a non-stream response."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0

    def add(self, event: GenerationEvent) -> None:
        self.text_parts.append(event.text)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.top_logprobs.extend(event.top_logprobs)
        self.finish_reason = event.finish_reason or self.finish_reason
        self.num_output_tokens = event.num_output_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def as_event(self) -> GenerationEvent:
        return GenerationEvent(text=self.text, token_ids=self.token_ids, logprobs=self.logprobs,
                               top_logprobs=self.top_logprobs, finish_reason=self.finish_reason,
                               num_output_tokens=self.num_output_tokens)


def usage(num_prompt_tokens: int, num_output_tokens: int) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                 total_tokens=num_prompt_tokens + num_output_tokens)


class _Responder:
    id_prefix = ""

    def __init__(self, model: str, speller: TokenSpeller, logprobs: bool) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.speller = speller
        self.logprobs = logprobs


class ChatResponder(_Responder):
    id_prefix = "chatcmpl"

    def _logprobs(self, event: GenerationEvent) -> ChatChoiceLogprobs | None:
        if not self.logprobs:
            return None
        s = self.speller
        content = []
        for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs, strict=False)):
            alternatives = event.top_logprobs[i] if i < len(event.top_logprobs) else []
            content.append(TokenLogprob(
                token=s.token_text(token_id), logprob=logprob, bytes=list(s.token_bytes(token_id)),
                top_logprobs=[TopLogprob(token=s.token_text(t), logprob=lp, bytes=list(s.token_bytes(t)))
                              for t, lp in alternatives]))
        return ChatChoiceLogprobs(content=content)

    def first_chunks(self, n: int) -> list[ChatCompletionChunk]:
        """OpenAI opens every choice's stream with the role and empty content."""
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(n)]

    def chunk(self, index: int, event: GenerationEvent) -> ChatCompletionChunk:
        delta = ChatDelta(content=event.text if event.text or event.finish_reason is None else None)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(event),
                                            finish_reason=event.finish_reason)])

    def usage_chunk(self, total: Usage) -> ChatCompletionChunk:
        return self._chunk([], total)

    def _chunk(self, choices: list[ChatChunkChoice], total: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=total)

    def response(self, outputs: list[ChoiceOutput], num_prompt_tokens: int) -> ChatCompletion:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=out.text),
                              logprobs=self._logprobs(out.as_event()), finish_reason=out.finish_reason)
                   for i, out in enumerate(outputs)]
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              system_fingerprint=SYSTEM_FINGERPRINT, choices=choices,
                              usage=usage(num_prompt_tokens, sum(o.num_output_tokens for o in outputs)))


class CompletionResponder(_Responder):
    id_prefix = "cmpl"

    def __init__(self, model: str, speller: TokenSpeller, logprobs: bool, n: int = 1) -> None:
        super().__init__(model, speller, logprobs)
        # text_offset counts characters from the start of each choice's text, across chunks.
        self._text_offsets = [0] * n

    def _logprobs(self, index: int, event: GenerationEvent) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        s = self.speller
        tokens = [s.token_text(t) for t in event.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offsets[index])
            self._text_offsets[index] += len(token)
        top = []
        for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs, strict=False)):
            alternatives = dict(event.top_logprobs[i]) if i < len(event.top_logprobs) else {}
            # OpenAI's legacy shape lists the chosen token too, even when it is not among the top.
            alternatives.setdefault(token_id, logprob)
            top.append({s.token_text(t): lp for t, lp in alternatives.items()})
        return CompletionLogprobs(tokens=tokens[:len(event.logprobs)], token_logprobs=list(event.logprobs),
                                  top_logprobs=top, text_offset=offsets[:len(event.logprobs)])

    def first_chunks(self, n: int) -> list[Completion]:
        return []

    def chunk(self, index: int, event: GenerationEvent) -> Completion:
        return self._completion([CompletionChoice(index=index, text=event.text,
                                                  logprobs=self._logprobs(index, event),
                                                  finish_reason=event.finish_reason)])

    def usage_chunk(self, total: Usage) -> Completion:
        return self._completion([], total)

    def _completion(self, choices: list[CompletionChoice], total: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=total)

    def response(self, outputs: list[ChoiceOutput], num_prompt_tokens: int) -> Completion:
        choices = [CompletionChoice(index=i, text=out.text, logprobs=self._logprobs(i, out.as_event()),
                                    finish_reason=out.finish_reason)
                   for i, out in enumerate(outputs)]
        return self._completion(choices, usage(num_prompt_tokens, sum(o.num_output_tokens for o in outputs)))


Responder = ChatResponder | CompletionResponder
# (choice index, event) pairs of all choices of one HTTP request, in arrival order.
ChoiceEvents = AsyncGenerator[tuple[int, GenerationEvent], None]


async def sse_stream(first: tuple[int, GenerationEvent], events: ChoiceEvents, responder: Responder, n: int,
                     include_usage: bool, num_prompt_tokens: int) -> AsyncIterator[str]:
    """The SSE body after the first event: every chunk, the usage chunk if asked, then [DONE]."""
    num_output_tokens = [0] * n
    try:
        for chunk in responder.first_chunks(n):
            yield sse_event(chunk)
        index, event = first
        num_output_tokens[index] = event.num_output_tokens
        yield sse_event(responder.chunk(index, event))
        async for index, event in events:
            num_output_tokens[index] = event.num_output_tokens
            yield sse_event(responder.chunk(index, event))
        if include_usage:
            yield sse_event(responder.usage_chunk(usage(num_prompt_tokens, sum(num_output_tokens))))
    except APIError as exc:
        # Headers are gone: the failure becomes the stream's last event, never a silent cut.
        yield error_sse_event(exc)
    except Exception as exc:
        logger.exception("stream failed")
        yield error_sse_event(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
    finally:
        await events.aclose()
    yield SSE_DONE
