"""Latency and throughput metrics of one benchmark level, from per-request timestamps.

Pure: loadgen (HTTP streams), engine_alone (engine steps) and hf_baselines fill RequestRecords;
summarize() turns a level's records into the numbers every report and plot uses.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


def process_cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads (Linux), so one service's CPU per token can be told
    apart from the others' on a shared machine: the sum of each thread's run time in ns
    (/proc/PID/task/TID/schedstat), where utime + stime count 10 ms ticks, too coarse for a run of
    a few thousand tokens. A thread that exits takes its time with it: the services' threads live
    as long as they do. Where schedstat is missing, utime + stime."""
    if Path(f"/proc/{pid}/schedstat").is_file():
        total_ns = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just exited
                total_ns += int((task / "schedstat").read_text().split()[0])
        return total_ns / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class RequestRecord:
    """One request's timeline. Times are time.perf_counter() seconds, all from one process."""

    start: float  # when the request was sent (its scheduled arrival in rate mode)
    # Arrival time of every chunk that carried output tokens, and how many tokens each carried:
    # a server may coalesce several tokens into one SSE chunk (tokenwire does under load).
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float = 0.0  # when the stream (or the engine's last output) ended
    num_prompt_tokens: int | None = None
    # The server's own count (usage) when it reports one, else sum(chunk_tokens).
    num_output_tokens: int = 0
    # False when chunk_tokens are a guess (each chunk's text re-encoded, or one per chunk) that the
    # server's total contradicts or cannot confirm; ITL then rests on the guessed counts.
    exact_token_counts: bool = True
    error: str | None = None

    def add_chunk(self, time: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunk_times.append(time)
            self.chunk_tokens.append(num_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    def itls(self) -> list[float]:
        """One inter-token latency per output token after the first.

        A chunk of k tokens that arrived g seconds after the previous chunk gives k samples of
        g / k: the server produced k tokens in g, and percentiles stay weighted per token (one
        sample per chunk would let a server that batches its output look like it has fewer, longer
        gaps). Extra tokens in the first chunk arrived with the first token: k - 1 samples of 0.
        """
        samples = [0.0] * (self.chunk_tokens[0] - 1) if self.chunk_tokens else []
        for i in range(1, len(self.chunk_times)):
            k = self.chunk_tokens[i]
            samples.extend([(self.chunk_times[i] - self.chunk_times[i - 1]) / k] * k)
        return samples


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (numpy's linear interpolation); None when empty."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if len(values_s) == 0:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


@dataclass
class LevelSummary:
    """What one concurrency (or request-rate) level measured."""

    concurrency: int | None  # requests in flight at most; None in open-loop rate mode
    request_rate: float | None  # requests/s of the Poisson arrivals; None in closed-loop mode
    num_requests: int
    completed: int
    failed: int
    duration_s: float  # first request sent -> last request ended
    request_throughput: float  # completed requests / duration_s
    output_throughput: float  # output tokens / duration_s
    total_token_throughput: float  # (prompt + output tokens) / duration_s
    total_output_tokens: int
    mean_prompt_tokens: float | None
    exact_token_counts: int  # requests whose per-chunk token counts are exact
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    errors: list[str]  # the first few distinct error messages
    # CPU seconds the client process spent on the level (the load generator sets it): what a
    # client on the server's own host takes from the server.
    client_cpu_s: float | None = None


def summarize(records: Sequence[RequestRecord], concurrency: int | None = None,
              request_rate: float | None = None) -> LevelSummary:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    if records:
        duration = max(r.end for r in records) - min(r.start for r in records)
    else:
        duration = 0.0
    out_tokens = sum(r.num_output_tokens for r in done)
    prompt_counts = [r.num_prompt_tokens for r in done if r.num_prompt_tokens is not None]
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    errors = list(dict.fromkeys(r.error or "no output tokens" for r in failed))[:5]
    return LevelSummary(
        concurrency=concurrency,
        request_rate=request_rate,
        num_requests=len(records),
        completed=len(done),
        failed=len(failed),
        duration_s=duration,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(out_tokens),
        total_token_throughput=per_s(out_tokens + sum(prompt_counts)),
        total_output_tokens=out_tokens,
        mean_prompt_tokens=(sum(prompt_counts) / len(prompt_counts)) if prompt_counts else None,
        exact_token_counts=sum(r.exact_token_counts for r in done),
        ttft_ms=distribution_ms([r.ttft for r in done]),
        tpot_ms=distribution_ms(tpots),
        itl_ms=distribution_ms([s for r in done for s in r.itls()]),
        e2e_ms=distribution_ms([r.e2e for r in done]),
        errors=errors,
    )
