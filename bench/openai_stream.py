"""One streamed OpenAI request, timed chunk by chunk: the payload, the SSE reader, the token counts.

Used by loadgen for every request; works against any OpenAI-compatible server (tokenwire's
gateway, vLLM, llama-cpp-python's llama_cpp.server).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from bench.metrics import RequestRecord
from bench.prompts import Prompt

Api = Literal["completions", "chat"]


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run asks for; extra_body is merged last (server-specific fields)."""

    api: Api
    model: str
    max_tokens: int
    ignore_eos: bool = True
    prompt_format: Literal["text", "ids"] = "text"  # ids: completions only (tokenwire and vLLM take them)
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def fixed_length(self) -> bool:
        """Every output is meant to be exactly max_tokens long: ignore_eos, or a min_tokens of
        max_tokens (llama-cpp-python's stand-in for it)."""
        return self.ignore_eos or self.extra_body.get("min_tokens") == self.max_tokens

    @property
    def path(self) -> str:
        return "/completions" if self.api == "completions" else "/chat/completions"

    def payload(self, prompt: Prompt) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            # include_usage: the exact total in a last chunk. continuous_usage_stats (vLLM's
            # extension) puts the running count in every chunk, which gives exact tokens per chunk;
            # servers that do not know it ignore it.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and tokenwire's extension
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.token_ids if self.prompt_format == "ids" else prompt.text
        body.update(self.extra_body)
        return body


class StreamError(Exception):
    """The server reported an error inside the stream (after its 200 headers)."""


class ChunkTokenCounter:
    """How many output tokens each SSE chunk carried, from the best source the server gives.

    1. a running usage.completion_tokens in every chunk (continuous usage stats): exact;
    2. the chunk's logprobs entries, when the request asked for logprobs: exact;
    3. otherwise a guess from the chunk's text: count_text(text) tokens (loadgen re-encodes it
       with the model's tokenizer), or one per chunk; checked against the final usage total.
    """

    def __init__(self, api: Api, count_text: Callable[[str], int] | None = None) -> None:
        self.api = api
        self.count_text = count_text
        self.counted = 0
        self.running_usage = 0
        # Usage has come with every chunk of choices so far: a running count (continuous usage
        # stats). A server that sends it only with its last chunk of choices (llama.cpp's
        # llama-server) gives the total there, not that chunk's tokens.
        self.usage_runs = True
        self.final_total: int | None = None
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.guessed = False

    def feed(self, chunk: dict[str, Any]) -> int:
        """Tokens in this chunk; raises StreamError on an error event."""
        if chunk.get("error"):
            error = chunk["error"]
            raise StreamError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        usage = chunk.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            self.final_total = usage["completion_tokens"]
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        choices = chunk.get("choices") or []
        if not choices:  # the usage-only last chunk
            return 0
        self.finish_reason = choices[0].get("finish_reason") or self.finish_reason
        if usage.get("completion_tokens") is None:
            self.usage_runs = False
        if self.usage_runs:
            num_tokens = usage["completion_tokens"] - self.running_usage
            self.running_usage = usage["completion_tokens"]
        else:
            num_tokens = self._from_choice(choices[0])
        self.counted += num_tokens
        return num_tokens

    def _from_choice(self, choice: dict[str, Any]) -> int:
        logprobs = choice.get("logprobs") or {}
        entries = logprobs.get("tokens") if self.api == "completions" else logprobs.get("content")
        if entries is not None:
            return len(entries)
        text = choice.get("text") if self.api == "completions" else (choice.get("delta") or {}).get("content")
        if not text:
            return 0
        self.guessed = True
        # A chunk that holds text holds at least one token, even where re-encoding merges it.
        return max(1, self.count_text(text)) if self.count_text else 1

    def finish(self, max_tokens: int) -> None:
        """Without any usage, a "length" finish still says how many tokens came: max_tokens."""
        if self.final_total is None and self.finish_reason == "length":
            self.final_total = max_tokens

    @property
    def total(self) -> int:
        return self.final_total if self.final_total is not None else self.counted

    @property
    def exact(self) -> bool:
        return not self.guessed or self.final_total == self.counted


DONE = "[DONE]"


def sse_data(line: str) -> str | None:
    """The payload of a `data:` line; None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip() or None


def sse_json(data: str) -> dict[str, Any]:
    """The JSON object of a `data:` payload other than [DONE]. Raises ValueError for a payload that
    is not a JSON object (the request then fails alone)."""
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise ValueError(f"SSE data is not a JSON object: {data[:100]}")
    return chunk


# aiohttp's own line reader refused a line past its read_bufsize: the same bound here.
MAX_LINE_BYTES = 1 << 22


class LineSplitter:
    """A response body's lines (each without its "\n"), from the pieces it arrives in.

    The load generator reads whatever bytes have come (aiohttp's iter_any) and splits them itself,
    as vLLM's benchmark client does, rather than awaiting aiohttp's line reader once per line: an
    SSE event is two lines, and at 32 streams the client shares the 2 cores with the server it
    measures (README, Performance: the client's CPU per token)."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._partial = b""

    def feed(self, data: bytes) -> list[str]:
        """The lines this piece completes. Raises ValueError for a line over max_line_bytes, or one
        that is not UTF-8."""
        if self._partial:
            data = self._partial + data
        complete, newline, self._partial = data.rpartition(b"\n")
        if len(self._partial) > self.max_line_bytes:
            raise ValueError(f"an SSE line over {self.max_line_bytes} bytes")
        return complete.decode().split("\n") if newline else []

    def rest(self) -> list[str]:
        """The last line, where the body ends without a line end."""
        partial, self._partial = self._partial, b""
        return [partial.decode()] if partial else []


# The longest a request waits for the server's next bytes before it fails: one stalled stream
# otherwise held its level, and the whole sweep, for good. Generous, as a server that runs one
# request at a time (llama-cpp-python's) leaves the last of 128 queued waiting minutes for its
# first byte.
READ_TIMEOUT_S = 600.0


def client_session(timeout_s: float | None = None, read_timeout_s: float = READ_TIMEOUT_S) -> aiohttp.ClientSession:
    """The HTTP client for a run: no connection cap (queueing belongs to the server under test).

    aiohttp rather than httpx: the load generator shares the machine with the server it measures,
    and on this 2-core host httpx's line reader cost 91 us of CPU per streamed token against
    aiohttp's 42 (scratch A/B through the gateway at 32 streams), CPU the server then lacks.
    read_bufsize: one SSE line (a chunk with many logprobs) may exceed aiohttp's 64 KiB default."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s, sock_read=read_timeout_s),
                                 read_bufsize=1 << 22)


async def stream_request(client: aiohttp.ClientSession, url: str, spec: RequestSpec, prompt: Prompt,
                         count_text: Callable[[str], int] | None = None) -> RequestRecord:
    """Sends one streamed request and times every chunk; failures land in record.error.
    count_text: tokens in a piece of output text, for servers that report no per-chunk counts."""
    counter = ChunkTokenCounter(spec.api, count_text)
    record = RequestRecord(start=time.perf_counter())
    saw_done = False
    try:
        async with client.post(url, json=spec.payload(prompt)) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                raise StreamError(f"HTTP {response.status}: {body[:300]}")
            lines = LineSplitter()
            async for piece in response.content.iter_any():
                now = time.perf_counter()  # every chunk in one piece came at once
                for line in lines.feed(piece):
                    saw_done = _take_line(line, now, record, counter) or saw_done
            for line in lines.rest():
                saw_done = _take_line(line, time.perf_counter(), record, counter) or saw_done
    except (StreamError, aiohttp.ClientError, ValueError, TimeoutError) as exc:  # ValueError: bad JSON, an over-long line
        record.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, StreamError) else str(exc)
    record.end = time.perf_counter()
    counter.finish(spec.max_tokens)
    record.num_output_tokens = counter.total
    # A stream cut short cleanly, or an output shorter than the run asked for, measured another
    # workload than the others: a failure, not a fast request.
    if record.error is None and not saw_done:
        record.error = "the stream ended without data: [DONE]"
    elif record.error is None and spec.fixed_length and counter.total != spec.max_tokens:
        record.error = (f"{counter.total} output tokens, not the {spec.max_tokens} asked "
                        f"(finish_reason {counter.finish_reason}): ignore_eos / min_tokens not honoured")
    # Without usage, the prompt's own length (exact for text prompts, see prompts.py; a server may add a BOS).
    record.num_prompt_tokens = counter.prompt_tokens if counter.prompt_tokens is not None else len(prompt.token_ids)
    record.exact_token_counts = counter.exact
    return record


def _take_line(line: str, now: float, record: RequestRecord, counter: ChunkTokenCounter) -> bool:
    """Records one SSE line's chunk (timed at now); True for the [DONE] line."""
    data = sse_data(line)
    if data is None:
        return False
    if data == DONE:
        return True
    record.add_chunk(now, counter.feed(sse_json(data)))
    return False
