"""Pipeline events → OpenAI response bodies and SSE chunks, for chat completions and completions.

app.py hands each choice's GenerationEvents to a ChatResponder or CompletionResponder, which
build the exact JSON objects the OpenAI SDK parses; sse_event frames them for a stream.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from gateway.errors import APIError, error_sse_event, internal_error
from gateway.openai_responses import (
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
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    VllmLogprob,
)
from gateway.reasoning_parsers import END as THINK_END
from gateway.reasoning_parsers import REASONING_PARSERS, ThinkStream, split_reasoning
from gateway.request_state import GenerationEvent, PromptLogprobs
from gateway.sse import sse_data
from gateway.token_rendering import TokenRenderer
from gateway.tool_parsers import TOOL_CALL_PARSERS, ToolCallStream, parse_tool_calls, strict_json

logger = logging.getLogger(__name__)

SYSTEM_FINGERPRINT = "tokenwire-0.1.0"
SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any], with_usage: bool = True) -> str:
    """One server-sent event: a `data:` line of JSON and the blank line that ends the event.

    Without stream_options.include_usage OpenAI's chunks have no `usage` key at all.
    """
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=None if with_usage else {"usage"})
    else:
        body = json.dumps(payload)
    return sse_data(body)


@dataclass
class PromptEcho:
    """A completions prompt as echo shows it: its text, ids and (with logprobs) their logprobs."""

    text: str
    token_ids: list[int]


@dataclass
class ChoiceOutput:
    """Everything one choice has produced, gathered for a non-stream response."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    part_token_counts: list[int] = field(default_factory=list)  # how many of token_ids came with each part
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    stop_reason: int | str | None = None

    def add(self, event: GenerationEvent) -> None:
        self.text_parts.append(event.text)
        self.token_ids.extend(event.token_ids)
        self.part_token_counts.append(len(event.token_ids))
        self.logprobs.extend(event.logprobs)
        self.top_logprobs.extend(event.top_logprobs)
        self.finish_reason = event.finish_reason or self.finish_reason
        self.num_output_tokens = event.num_output_tokens
        self.num_cached_prompt_tokens = event.num_cached_prompt_tokens
        self.prompt_logprobs = event.prompt_logprobs or self.prompt_logprobs
        self.stop_reason = event.stop_reason if event.stop_reason is not None else self.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def as_event(self) -> GenerationEvent:
        return GenerationEvent(text=self.text, token_ids=self.token_ids, logprobs=self.logprobs,
                               top_logprobs=self.top_logprobs, finish_reason=self.finish_reason,
                               num_output_tokens=self.num_output_tokens, prompt_logprobs=self.prompt_logprobs,
                               stop_reason=self.stop_reason)


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_prompt_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                 total_tokens=num_prompt_tokens + num_output_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_prompt_tokens))


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """A response's token counts so far. A stream with continuous_usage_stats writes them in every
    chunk: json() joins the same JSON as usage(...).model_dump_json() in 0.4 us instead of 4
    (measured), and model() builds the pydantic model where a chunk goes through the models."""

    prompt: int
    output: int
    cached: int = 0

    def model(self) -> Usage:
        return usage(self.prompt, self.output, self.cached)

    def json(self) -> str:
        return (f'{{"prompt_tokens":{self.prompt},"completion_tokens":{self.output},'
                f'"total_tokens":{self.prompt + self.output},'
                f'"prompt_tokens_details":{{"cached_tokens":{self.cached},"audio_tokens":0}}}}')


def vllm_prompt_logprobs(speller: TokenRenderer, prompt_ids: list[int],
                         prompt_logprobs: PromptLogprobs | None) -> list[dict[str, VllmLogprob] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, None for the first, else the token and
    its alternatives keyed by id."""
    if prompt_logprobs is None:
        return None
    rendered: list[dict[str, VllmLogprob] | None] = []
    for position, token_id in enumerate(prompt_ids):
        logprob = prompt_logprobs.logprobs[position] if position < len(prompt_logprobs.logprobs) else None
        if logprob is None:
            rendered.append(None)
            continue
        rank = prompt_logprobs.ranks[position] if position < len(prompt_logprobs.ranks) else 0
        entry = {str(token_id): VllmLogprob(logprob=logprob, rank=rank or None,
                                            decoded_token=speller.token_text(token_id))}
        alternatives = prompt_logprobs.top_logprobs[position] if position < len(prompt_logprobs.top_logprobs) else []
        for rank, (alt, alt_logprob) in enumerate(alternatives, start=1):
            entry.setdefault(str(alt), VllmLogprob(logprob=alt_logprob, rank=rank,
                                                   decoded_token=speller.token_text(alt)))
        rendered.append(entry)
    return rendered


def _json_text(text: str | None) -> str:
    return json.dumps(text, ensure_ascii=False)


class _Responder:
    id_prefix = ""
    object_name = ""

    def __init__(self, model: str, speller: TokenRenderer, logprobs: bool, include_usage: bool = False) -> None:
        self.created = int(time.time())
        self.model = model
        self.speller = speller
        self.logprobs = logprobs
        # Stream chunks carry a `usage` key (null until the last) only when the client asked.
        self.include_usage = include_usage
        self.continuous_usage = False  # stream_options.continuous_usage_stats; set by the route
        self.return_token_ids = False  # vLLM's return_token_ids; set by the route
        self.use_request_id(uuid.uuid4().hex)

    def use_request_id(self, request_id: str) -> None:
        """The response's id from the HTTP request's (its X-Request-Id, or the one the gateway gave
        it), as vLLM builds "chatcmpl-<request id>": a client's trace id, and the access log's
        request_id, find the response."""
        self.id = f"{self.id_prefix}-{request_id}"
        # The start of every stream chunk's JSON, up to its choices list.
        self._chunk_head = (f'{{"id":{_json_text(self.id)},"object":"{self.object_name}","created":{self.created},'
                            f'"model":{_json_text(self.model)},"system_fingerprint":"{SYSTEM_FINGERPRINT}",'
                            '"choices":[')

    def _prompt_ids(self, index: int) -> list[int]:
        raise NotImplementedError

    def _prompt_index(self, choice: int) -> int:
        return 0

    def chunk(self, index: int, event: GenerationEvent) -> ChatCompletionChunk | Completion:
        raise NotImplementedError

    def _plain_choice_json(self, index: int, event: GenerationEvent) -> str | None:
        raise NotImplementedError

    def stream_chunk_json(self, index: int, event: GenerationEvent, total: UsageCounts | None = None,
                          with_usage: bool = True) -> str | None:
        """One stream chunk's JSON, with `usage` (total, or null) when with_usage. The common
        chunk (text only: no logprobs, no echo still to show) is joined from cached parts,
        where building and dumping the pydantic models costs 4-9 us a token (measured); the
        others go through the models. tests/test_gateway_responses.py holds both to the same JSON.
        None: this event makes no chunk (a "required" tool call list still being generated)."""
        choice = self._plain_choice_json(index, event)
        if choice is None:
            chunk = self.chunk(index, event)
            if chunk is None:
                return None
            chunk.usage = total.model() if total is not None else None
            return chunk.model_dump_json(exclude=None if with_usage else {"usage"})
        usage_json = "" if not with_usage else ',"usage":' + (total.json() if total is not None else "null")
        return f"{self._chunk_head}{choice}]{usage_json}}}"

    def add_token_ids(self, response: dict[str, Any], outputs: list[ChoiceOutput]) -> None:
        """vLLM's return_token_ids on a whole response: each choice's output ids, and the prompt's."""
        for index, (choice, out) in enumerate(zip(response["choices"], outputs, strict=True)):
            choice["token_ids"] = out.token_ids
            self.add_prompt_token_ids(response, choice, index)

    def add_stream_token_ids(self, chunk_json: str, token_ids: list[int], first_of_choice: bool) -> str:
        """vLLM's return_token_ids on a stream chunk of one choice: the ids since its last chunk, and
        with the choice's first, its prompt's ids where they go in the choice (completions; chat's
        go on each choice's role chunk, in sse_stream)."""
        chunk = json.loads(chunk_json)
        (choice,) = chunk["choices"]
        choice["token_ids"] = token_ids
        if first_of_choice and self.prompt_ids_in_choice:
            self.add_prompt_token_ids(chunk, choice, choice["index"])
        return json.dumps(chunk, ensure_ascii=False)

    # Where return_token_ids puts the prompt's ids: in each choice (completions) or in the response.
    prompt_ids_in_choice = False

    def add_prompt_token_ids(self, response: dict[str, Any], choice: dict[str, Any], index: int) -> None:
        raise NotImplementedError

    def num_cached_prompt_tokens(self, per_choice: list[int]) -> int:
        """The request's cached prompt tokens: each prompt counted once, though its n choices
        (which share its prefill) all report it."""
        per_prompt: dict[int, int] = {}
        for choice, num_cached in enumerate(per_choice):
            prompt = self._prompt_index(choice)
            per_prompt[prompt] = max(per_prompt.get(prompt, 0), num_cached)
        return sum(per_prompt.values())

    async def prepare(self, index: int, event: GenerationEvent) -> None:
        """Has the renderer ready for every token this event's logprobs will show."""
        ids: set[int] = set()
        if self.logprobs:
            ids.update(event.token_ids)
            ids.update(t for row in event.top_logprobs for t, _ in row)
        if event.prompt_logprobs is not None:  # echoed prompt tokens, vLLM's prompt_logprobs
            ids.update(self._prompt_ids(index))
            ids.update(t for row in event.prompt_logprobs.top_logprobs for t, _ in row)
        if ids:
            await self.speller.ensure(ids)


@dataclass(frozen=True)
class ToolCallMode:
    """How a chat request's tool calls come out. Forced (ChatCompletionRequest.tool_call_schema):
    named, the output is that function's arguments; required, a JSON array of {name, parameters}
    calls. Chosen by the model ("auto" with a --tool-call-parser): the parser finds the calls in
    the model's own syntax, and the rest of the text is the content."""

    named: str | None = None  # the function's name; None: "required" (or auto)
    parser: str | None = None  # auto: the tool_parsers name
    parallel: bool = True  # auto: False keeps the first call only (parallel_tool_calls, vLLM's rule)

    @classmethod
    def of(cls, body: Any, parser: str | None = None) -> ToolCallMode | None:
        """The mode of a ChatCompletionRequest, or None where its output is plain text."""
        if body.forces_tool_call():
            named = body.named_tool()
            return cls(named.function.name if named is not None else None)
        if parser and body.lets_model_choose_tool():
            return cls(parser=parser, parallel=body.parallel_tool_calls)
        return None

    @staticmethod
    def call_id() -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def calls(self, text: str) -> list[ToolCall] | None:
        """The output as tool calls; None where it is not a whole call list (cut by max_tokens)."""
        if self.named is not None:  # no text: no call (the output ended while thinking)
            return [ToolCall(id=self.call_id(), function=FunctionCall(name=self.named, arguments=text))] if text else None
        try:
            items = strict_json(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
            return None
        return [ToolCall(id=self.call_id(), function=FunctionCall(
            name=str(item["name"]), arguments=json.dumps(item.get("parameters", {}), ensure_ascii=False)))
            for item in items]


class ChatResponder(_Responder):
    id_prefix = "chatcmpl"
    object_name = "chat.completion.chunk"

    def __init__(self, model: str, speller: TokenRenderer, logprobs: bool, include_usage: bool = False,
                 prompt_token_ids: list[int] | None = None, tool_calls: ToolCallMode | None = None,
                 reasoning_parser: str | None = None, prompt_tail: str = "", constrained: bool = False,
                 think_end_id: int | None = None, echo_text: str = "") -> None:
        super().__init__(model, speller, logprobs, include_usage)
        self.prompt_token_ids = prompt_token_ids or []
        # echo: the text every choice's answer starts with (the prefill it continues), as it
        # came, ahead of what the parsers make of the generated text.
        self.echo_text = echo_text
        self.tool_calls = tool_calls
        # reasoning_parsers' name: the thinking goes out as `reasoning`, apart from the content;
        # prompt_tail: the end of the prompt, which may have opened or closed the thinking.
        self.reasoning_parser = reasoning_parser
        self.prompt_tail = prompt_tail
        self.constrained = constrained  # by a grammar: the answer's leading whitespace is kept
        # The token the model worker starts a deferred grammar after (StructuredOutput.after_token_ids):
        # the thinking ends where that token came, not at a "</think>" spelled in other tokens.
        self.think_end_id = think_end_id
        self._think_ended: set[int] = set()  # the choices whose think_end_id has come
        self._reasoning_streams: dict[int, ThinkStream] = {}
        # Streams of a forced call: the choices whose call has opened (a named call streams its
        # arguments as they come), and the text of each "required" call list until it is whole.
        self._opened_calls: set[int] = set()
        self._call_text: dict[int, list[str]] = {}
        self._call_parsers: dict[int, ToolCallStream] = {}  # auto: each choice's parser

    def _prompt_ids(self, index: int) -> list[int]:
        return self.prompt_token_ids

    def add_prompt_token_ids(self, response: dict[str, Any], choice: dict[str, Any], index: int) -> None:
        response["prompt_token_ids"] = self.prompt_token_ids  # the response's, as vLLM's chat puts them

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
        """OpenAI opens every choice's stream with the role and empty content; with echo, a chunk
        of the echoed text follows for each choice (vLLM's order)."""
        chunks = [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                  for i in range(n)]
        if self.echo_text:
            chunks += [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=self.echo_text))])
                       for i in range(n)]
        return chunks

    @staticmethod
    def _delta_content(event: GenerationEvent) -> str | None:
        """The delta's content: None (no key) only on a last event without text."""
        return event.text if event.text or event.finish_reason is None else None

    def _plain_choice_json(self, index: int, event: GenerationEvent) -> str | None:
        if self.logprobs or self.tool_calls is not None or self.reasoning_parser is not None:
            return None
        content = self._delta_content(event)
        delta = "{}" if content is None else f'{{"content":{_json_text(content)}}}'
        return (f'{{"index":{index},"delta":{delta},"logprobs":null,'
                f'"finish_reason":{_json_text(event.finish_reason)},"stop_reason":{_json_text(event.stop_reason)}}}')

    def chunk(self, index: int, event: GenerationEvent) -> ChatCompletionChunk | None:
        reasoning = ""
        if self.reasoning_parser is not None:
            reasoning, content = self._split_reasoning(index, event)
            event = dataclasses.replace(event, text=content)
        delta, finish_reason = ChatDelta(content=self._delta_content(event)), event.finish_reason
        if self.tool_calls is not None:
            delta, finish_reason = self._tool_call_delta(index, event)
            if delta is None and not self.logprobs and not reasoning:
                return None  # nothing to say yet (vLLM sends no chunk either)
            delta = delta or ChatDelta()
        if self.reasoning_parser is not None:
            delta.content = delta.content or None  # a thinking delta has no content key
            delta.reasoning = delta.reasoning_content = reasoning or None
            if not (reasoning or delta.content or delta.tool_calls or finish_reason or self.logprobs):
                return None  # all held back (a tag that may be starting)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(event),
                                            finish_reason=finish_reason, stop_reason=event.stop_reason)])

    def _reasoning_stream(self) -> ThinkStream:
        assert self.reasoning_parser is not None
        return REASONING_PARSERS[self.reasoning_parser](self.prompt_tail, self.constrained)

    def _split_reasoning(self, index: int, event: GenerationEvent) -> tuple[str, str]:
        """This event's (reasoning, content), from the choice's parser."""
        stream = self._reasoning_streams.get(index)
        if stream is None:
            stream = self._reasoning_streams[index] = self._reasoning_stream()
        brings_end_token = index not in self._think_ended and self.think_end_id in event.token_ids
        if brings_end_token:
            self._think_ended.add(index)
        reasoning, content = stream.feed(event.text, self.think_end_id is None or index in self._think_ended,
                                         brings_end_token,
                                         self._ends_after_think_end(event.token_ids) if brings_end_token else 0)
        if event.finish_reason is not None:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _ends_after_think_end(self, token_ids: list[int]) -> int:
        """How many "</think>" the tokens after think_end_id (which token_ids hold) spell in their
        own text (the answer writing the tag just after the real token, in the same event); 0 where
        the renderer does not know them (it renders a stream's tokens only when logprobs are asked for)."""
        after = token_ids[token_ids.index(self.think_end_id) + 1:]
        try:
            text = b"".join(self.speller.token_bytes(t) for t in after).decode("utf-8", "replace")
        except KeyError:
            return 0
        return text.count(THINK_END)

    def _tool_call_delta(self, index: int, event: GenerationEvent) -> tuple[ChatDelta | None, str | None]:
        """A forced call's stream (vLLM's shape): a named call opens with its id and name and
        streams its arguments as they come; a "required" list is sent whole with its last event,
        once it can be parsed (each call's arguments come from its own object in the list)."""
        mode = self.tool_calls
        assert mode is not None
        if mode.parser is not None:
            return self._chosen_call_delta(index, event, mode.parser)
        if mode.named is not None:
            if not event.text and index not in self._opened_calls:
                # Nothing of the call yet (the model may still be thinking); an output that ends
                # so (stopped or cut while thinking) has no call, as a "required" one that never
                # parsed has none.
                return (None if event.finish_reason is None else ChatDelta()), event.finish_reason
            if index in self._opened_calls:
                calls = [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=event.text))] if event.text else None
            else:
                self._opened_calls.add(index)
                calls = [DeltaToolCall(index=0, id=mode.call_id(), type="function",
                                       function=DeltaFunctionCall(name=mode.named, arguments=event.text))]
            return ChatDelta(tool_calls=calls), event.finish_reason
        self._call_text.setdefault(index, []).append(event.text)
        if event.finish_reason is None:
            return None, None
        text = "".join(self._call_text.pop(index))
        whole = mode.calls(text)
        if whole is None:  # cut short: the text as it came, with its finish reason
            return ChatDelta(content=text), event.finish_reason
        calls = [DeltaToolCall(index=i, id=call.id, type="function",
                               function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                 for i, call in enumerate(whole)]
        return ChatDelta(tool_calls=calls), "tool_calls" if event.finish_reason == "stop" else event.finish_reason

    def _chosen_call_delta(self, index: int, event: GenerationEvent, parser: str) -> tuple[ChatDelta | None, str | None]:
        """tool_choice "auto": the content as the parser lets it out (a tag that may be starting
        is held back), and each call whole once its block closes."""
        stream = self._call_parsers.get(index)
        if stream is None:
            stream = self._call_parsers[index] = TOOL_CALL_PARSERS[parser]()
        first_call = stream.num_calls
        content, calls = stream.feed(event.text)
        finish_reason = event.finish_reason
        if finish_reason is not None:
            more_content, more_calls = stream.finish()
            content, calls = content + more_content, calls + more_calls
            if stream.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if not self.tool_calls.parallel:
            calls = calls[:max(0, 1 - first_call)]
        deltas = [DeltaToolCall(index=first_call + i, id=ToolCallMode.call_id(), type="function",
                                function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
                  for i, call in enumerate(calls)]
        if not content and not deltas:  # a last event still makes its chunk, for the finish reason
            return (None if finish_reason is None else ChatDelta()), finish_reason
        return ChatDelta(content=content or None, tool_calls=deltas or None), finish_reason

    def usage_chunk(self, total: Usage) -> ChatCompletionChunk:
        return self._chunk([], total)

    def _message(self, out: ChoiceOutput) -> tuple[AssistantMessage, str | None]:
        """A choice's message and finish reason: its text, or (forced) its tool calls, with no
        content (OpenAI's) and, for "required", finish_reason tool_calls (vLLM's; a named call
        keeps stop, as OpenAI's does). With a reasoning parser, the thinking is split off first."""
        text, reasoning = out.text, None
        if self.reasoning_parser is not None and self.think_end_id is None:
            reasoning, text = split_reasoning(self.reasoning_parser, text, self.prompt_tail, self.constrained)
        elif self.reasoning_parser is not None:
            # Part by part, as the stream went: the thinking ends with the part that brought the token.
            stream, ended, start = self._reasoning_stream(), False, 0
            reasoning_parts, content_parts = [], []
            for part, count in zip(out.text_parts, out.part_token_counts, strict=True):
                part_ids = out.token_ids[start:start + count]
                brings_end_token = not ended and self.think_end_id in part_ids
                ended = ended or brings_end_token
                start += count
                more_reasoning, more_content = stream.feed(part, ended, brings_end_token,
                                                           self._ends_after_think_end(part_ids) if brings_end_token else 0)
                reasoning_parts.append(more_reasoning)
                content_parts.append(more_content)
            more_reasoning, more_content = stream.finish()
            reasoning, text = "".join(reasoning_parts) + more_reasoning, "".join(content_parts) + more_content
        message, finish = self._answer(text, out.finish_reason)
        if self.reasoning_parser is not None:
            message.content = message.content or None
            message.reasoning = message.reasoning_content = reasoning or None
        if self.echo_text:
            message.content = self.echo_text + (message.content or "")
        return message, finish

    def _answer(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        mode = self.tool_calls
        if mode is not None and mode.parser is not None:
            content, chosen = parse_tool_calls(mode.parser, text)
            if not chosen:
                return AssistantMessage(content=text), finish_reason
            chosen = chosen if mode.parallel else chosen[:1]
            calls = [ToolCall(id=mode.call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in chosen]
            return (AssistantMessage(content=content or None, tool_calls=calls),
                    "tool_calls" if finish_reason == "stop" else finish_reason)
        calls = mode.calls(text) if mode is not None else None
        if mode is None or calls is None:
            return AssistantMessage(content=text), finish_reason
        finish = finish_reason if mode.named is not None or finish_reason != "stop" else "tool_calls"
        return AssistantMessage(content=None, tool_calls=calls), finish

    def _chunk(self, choices: list[ChatChunkChoice], total: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=total)

    def response(self, outputs: list[ChoiceOutput], num_prompt_tokens: int) -> ChatCompletion:
        choices = [ChatChoice(index=i, message=message, logprobs=self._logprobs(out.as_event()),
                              finish_reason=finish_reason, stop_reason=out.stop_reason)
                   for i, out in enumerate(outputs) for message, finish_reason in [self._message(out)]]
        prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None)
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              system_fingerprint=SYSTEM_FINGERPRINT, choices=choices,
                              usage=usage(num_prompt_tokens, sum(o.num_output_tokens for o in outputs),
                                          self.num_cached_prompt_tokens([o.num_cached_prompt_tokens for o in outputs])),
                              prompt_logprobs=vllm_prompt_logprobs(self.speller, self.prompt_token_ids,
                                                                   prompt_logprobs))


class CompletionResponder(_Responder):
    """Choices of a batch of prompts: choice i answers prompts[i // n] (OpenAI's order)."""

    id_prefix = "cmpl"
    object_name = "text_completion"

    def __init__(self, model: str, speller: TokenRenderer, logprobs: bool, prompts: list[PromptEcho],
                 n: int = 1, echo: bool = False, include_usage: bool = False, num_top_logprobs: int = 0,
                 prompt_logprobs: bool = False, skipped_ids: frozenset[int] = frozenset(),
                 special_ids: frozenset[int] = frozenset()) -> None:
        """num_top_logprobs: the request's logprobs=N (alternatives per token, echoed prompt tokens
        included); prompt_logprobs: it asked for vLLM's prompt_logprobs field (echo with logprobs
        fetches them too, for the echoed tokens alone); skipped_ids: the special tokens the output's
        text leaves out (skip_special_tokens), which move no text_offset; special_ids: all of them,
        for an echoed text prompt, which is the text as sent (a BOS the tokenizer added is not in it)."""
        super().__init__(model, speller, logprobs, include_usage)
        self.skipped_ids = skipped_ids
        self.special_ids = special_ids
        self.prompts = prompts
        self.n = n
        self.echo = echo
        self.num_top_logprobs = num_top_logprobs
        self.wants_prompt_logprobs = prompt_logprobs
        num_choices = len(prompts) * n
        # text_offset counts characters from the start of each choice's text, across chunks.
        self._text_offsets = [0] * num_choices
        self._partial_char = [b""] * num_choices  # each choice's bytes of a character still unfinished
        self._echoed = [False] * num_choices

    def _prompt(self, index: int) -> PromptEcho:
        return self.prompts[index // self.n]

    prompt_ids_in_choice = True

    def add_prompt_token_ids(self, response: dict[str, Any], choice: dict[str, Any], index: int) -> None:
        choice["prompt_token_ids"] = self._prompt(index).token_ids  # each choice's prompt, as vLLM's completions

    def _prompt_index(self, choice: int) -> int:
        return choice // self.n

    def _prompt_ids(self, index: int) -> list[int]:
        return self._prompt(index).token_ids

    def _logprobs(self, index: int, event: GenerationEvent, echo: PromptEcho | None) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        s = self.speller
        token_ids: list[int] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        if echo is not None:
            prompt_lps = event.prompt_logprobs
            for position, token_id in enumerate(echo.token_ids):
                logprob = prompt_lps.logprobs[position] if prompt_lps and position < len(prompt_lps.logprobs) else None
                token_ids.append(token_id)
                token_logprobs.append(logprob)
                if logprob is None:
                    top.append(None)
                    continue
                # As many as the output tokens get, even where prompt_logprobs asked for more.
                alternatives = dict(prompt_lps.top_logprobs[position][:self.num_top_logprobs]) if prompt_lps else {}
                alternatives.setdefault(token_id, logprob)
                top.append({s.token_text(t): lp for t, lp in alternatives.items()})
        for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs, strict=False)):
            alternatives = dict(event.top_logprobs[i]) if i < len(event.top_logprobs) else {}
            # OpenAI's legacy shape lists the chosen token too, even when it is not among the top.
            alternatives.setdefault(token_id, logprob)
            token_ids.append(token_id)
            token_logprobs.append(logprob)
            top.append({s.token_text(t): lp for t, lp in alternatives.items()})
        tokens = [s.token_text(t) for t in token_ids]
        offsets = []
        num_echoed = len(echo.token_ids) if echo is not None else 0
        for i, token_id in enumerate(token_ids):
            # In characters of the text: a token that ends inside a character adds none, the one
            # that completes it adds one (its label "bytes:\xNN" is no measure of the text), and a
            # special token the output's text leaves out adds none.
            offsets.append(self._text_offsets[index])
            if i >= num_echoed and token_id in self.skipped_ids:
                continue
            piece = s.token_bytes(token_id)
            if i < num_echoed and token_id in self.special_ids and not echo.text.startswith(
                    piece.decode("utf-8", "replace"), self._text_offsets[index]):
                continue  # added by the tokenizer (a BOS): the echoed text as sent has no such piece
            data = self._partial_char[index] + piece
            text, consumed = codecs.utf_8_decode(data, "replace", i == num_echoed - 1)
            # An echoed prompt that ends inside a character ends in U+FFFD there (final decode):
            # the output's text starts afresh, as the detok worker does not finish the character.
            self._text_offsets[index] += len(text)
            self._partial_char[index] = data[consumed:]
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top,
                                  text_offset=offsets)

    def _choice(self, index: int, event: GenerationEvent) -> CompletionChoice:
        echo = None
        if self.echo and not self._echoed[index]:
            self._echoed[index] = True
            echo = self._prompt(index)
        text = event.text if echo is None else echo.text + event.text
        return CompletionChoice(index=index, text=text, logprobs=self._logprobs(index, event, echo),
                                finish_reason=event.finish_reason, stop_reason=event.stop_reason)

    def first_chunks(self, n: int) -> list[Completion]:
        return []

    def _plain_choice_json(self, index: int, event: GenerationEvent) -> str | None:
        if self.logprobs or (self.echo and not self._echoed[index]):
            return None
        return (f'{{"index":{index},"text":{_json_text(event.text)},"logprobs":null,'
                f'"finish_reason":{_json_text(event.finish_reason)},"stop_reason":{_json_text(event.stop_reason)},'
                '"prompt_logprobs":null}')

    def chunk(self, index: int, event: GenerationEvent) -> Completion:
        return self._completion([self._choice(index, event)])

    def usage_chunk(self, total: Usage) -> Completion:
        return self._completion([], total)

    def _completion(self, choices: list[CompletionChoice], total: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model,
                          system_fingerprint=SYSTEM_FINGERPRINT, choices=choices, usage=total)

    def response(self, outputs: list[ChoiceOutput], num_prompt_tokens: int) -> Completion:
        choices = []
        for i, out in enumerate(outputs):
            choice = self._choice(i, out.as_event())
            if self.wants_prompt_logprobs:
                choice.prompt_logprobs = vllm_prompt_logprobs(self.speller, self._prompt(i).token_ids,
                                                              out.prompt_logprobs)
            choices.append(choice)
        return self._completion(choices, usage(
            num_prompt_tokens, sum(o.num_output_tokens for o in outputs),
            self.num_cached_prompt_tokens([o.num_cached_prompt_tokens for o in outputs])))


Responder = ChatResponder | CompletionResponder
# (choice index, event) pairs of all choices of one HTTP request, in arrival order.
ChoiceEvents = AsyncGenerator[tuple[int, GenerationEvent], None]


async def sse_stream(first: tuple[int, GenerationEvent], events: ChoiceEvents, responder: Responder,
                     num_prompt_tokens: int, choice_prompt_tokens: Sequence[int]) -> AsyncIterator[str]:
    """The SSE body after the first event: every chunk (choices interleaved as their events come),
    the usage chunk if asked, then [DONE]. choice_prompt_tokens: each choice's prompt's length."""
    num_choices = len(choice_prompt_tokens)
    num_output_tokens = [0] * num_choices
    num_cached = [0] * num_choices
    with_usage = responder.include_usage
    continuous_usage = with_usage and responder.continuous_usage
    # return_token_ids: each choice's ids not yet sent (an event may make no chunk: a tool call or
    # a think tag held back), and the choices that have had a chunk.
    unsent_ids: list[list[int]] = [[] for _ in range(num_choices)]
    started: set[int] = set()

    def totals() -> UsageCounts:
        return UsageCounts(num_prompt_tokens, sum(num_output_tokens), responder.num_cached_prompt_tokens(num_cached))

    def choice_usage(index: int) -> UsageCounts:
        """continuous_usage_stats' counts in a choice's chunk: its prompt's and its own, as vLLM's."""
        return UsageCounts(choice_prompt_tokens[index], num_output_tokens[index], num_cached[index])

    async def event_chunk(index: int, event: GenerationEvent) -> str | None:
        num_output_tokens[index] = event.num_output_tokens
        num_cached[index] = event.num_cached_prompt_tokens
        await responder.prepare(index, event)
        chunk = responder.stream_chunk_json(index, event, choice_usage(index) if continuous_usage else None,
                                            with_usage)
        if responder.return_token_ids:
            unsent_ids[index].extend(event.token_ids)
            if chunk is not None:
                chunk = responder.add_stream_token_ids(chunk, unsent_ids[index], index not in started)
                unsent_ids[index] = []
                started.add(index)
        return None if chunk is None else sse_data(chunk)

    try:
        for number, chunk in enumerate(responder.first_chunks(num_choices)):
            if continuous_usage:  # the role and echo chunks too, as vLLM's: the prompt, nothing generated yet
                chunk.usage = choice_usage(chunk.choices[0].index).model()
            if responder.return_token_ids and number < num_choices:  # chat's prompt ids: each choice's role chunk
                head = chunk.model_dump(exclude=None if with_usage else {"usage"})
                responder.add_prompt_token_ids(head, head["choices"][0], number)
                yield sse_event(head)
                continue
            yield sse_event(chunk, with_usage)
        chunk = await event_chunk(*first)
        if chunk is not None:
            yield chunk
        async for index, event in events:
            chunk = await event_chunk(index, event)
            if chunk is not None:
                yield chunk
        if with_usage:
            yield sse_event(responder.usage_chunk(totals().model()))
    except APIError as exc:
        # Headers are gone: the failure becomes the stream's last event, never a silent cut.
        yield error_sse_event(exc)
    except Exception as exc:
        logger.exception("stream failed")
        yield error_sse_event(internal_error(exc))
    finally:
        await events.aclose()
    yield SSE_DONE
