"""The workload every benchmark tool runs: prompt and output lengths, and the levels to sweep.

One dataclass built from the same flags in loadgen, engine_alone and hf_baselines, so the
side-by-side comparison hands each of them the same workload and they build the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


@dataclass(frozen=True)
class Level:
    concurrency: int | None  # at most this many requests in flight; None: no cap (rate mode)
    request_rate: float | None  # Poisson arrivals per second; None: closed loop
    num_requests: int
    # Levels take disjoint slices of one prompt pool, so a server's prefix cache never turns a
    # later level's prefill into a cache hit.
    first_prompt: int = 0

    def prompts(self, pool: list) -> list:
        return pool[self.first_prompt:self.first_prompt + self.num_requests]


# Prompts at the end of the pool, used only by warm-up requests.
WARMUP_PROMPTS = 4


@dataclass
class Workload:
    prompt_len: int = 32
    output_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 8, 32)
    # Open-loop mode when given: Poisson arrivals at each rate, capped at max_concurrency if > 0.
    request_rate: tuple[float, ...] = ()
    max_concurrency: int = 0
    num_requests: int = 0  # per level; 0: waves * concurrency (closed loop) or 64 (rate mode)
    waves: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        self.concurrency = tuple(self.concurrency)
        self.request_rate = tuple(self.request_rate)
        if self.prompt_len < 1 or self.output_tokens < 1:
            raise ValueError("--prompt-len and --output-tokens must be >= 1")
        if not self.request_rate and (not self.concurrency or min(self.concurrency) < 1):
            raise ValueError("--concurrency needs one or more values >= 1")
        if any(r <= 0 for r in self.request_rate):
            raise ValueError("--request-rate values must be > 0")
        if self.num_requests < 0 or self.waves < 1 or self.max_concurrency < 0:
            raise ValueError("--num-requests and --max-concurrency must be >= 0, --waves >= 1")

    def levels(self) -> Iterator[Level]:
        first = 0
        if self.request_rate:
            for rate in self.request_rate:
                yield Level(self.max_concurrency or None, rate, self.num_requests or 64, first)
                first += self.num_requests or 64
        else:
            for concurrency in self.concurrency:
                num_requests = self.num_requests or self.waves * concurrency
                yield Level(concurrency, None, num_requests, first)
                first += num_requests

    @property
    def pool_size(self) -> int:
        """Prompts every level needs, plus the warm-up ones at the end."""
        return sum(level.num_requests for level in self.levels()) + WARMUP_PROMPTS

    def warmup_prompts(self, pool: list) -> list:
        return pool[-WARMUP_PROMPTS:]

    @property
    def max_in_flight(self) -> int:
        """The most requests any level has in flight: the engine's batch size must fit it."""
        return max(level.concurrency or level.num_requests for level in self.levels())


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the level's start at which each request is sent: a Poisson process."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps).tolist()


async def run_arrivals(level: Level, seed: int, send: Callable[[int], Awaitable[T]]) -> list[T]:
    """send(i) for each of the level's requests: at most `concurrency` at once (closed loop), or at
    Poisson arrival times; the results in request order."""
    in_flight = asyncio.Semaphore(level.concurrency) if level.concurrency else None
    offsets = (arrival_offsets(level.num_requests, level.request_rate, seed) if level.request_rate
               else [0.0] * level.num_requests)
    level_start = time.perf_counter()

    async def one(index: int) -> T:
        delay = level_start + offsets[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if in_flight is None:
            return await send(index)
        async with in_flight:
            return await send(index)

    return list(await asyncio.gather(*(one(i) for i in range(level.num_requests))))


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    group.add_argument("--output-tokens", type=int, default=64, help="output tokens per request (max_tokens)")
    group.add_argument("--concurrency", type=int_list, default=[1, 8, 32],
                       help="comma-separated concurrency levels (closed loop)")
    group.add_argument("--request-rate", type=float_list, default=[],
                       help="comma-separated Poisson request rates (req/s); replaces the concurrency sweep")
    group.add_argument("--max-concurrency", type=int, default=0, help="cap on in-flight requests in rate mode")
    group.add_argument("--num-requests", type=int, default=0,
                       help="requests per level; 0: waves x concurrency, or 64 in rate mode")
    group.add_argument("--waves", type=int, default=1, help="requests per level = waves x concurrency")
    group.add_argument("--seed", type=int, default=0, help="prompts and arrival times")


def workload_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Workload:
    """The Workload the flags describe; a bad combination ends the command with parser.error."""
    try:
        return Workload(args.prompt_len, args.output_tokens, tuple(args.concurrency), tuple(args.request_rate),
                        args.max_concurrency, args.num_requests, args.waves, args.seed)
    except ValueError as exc:
        parser.error(str(exc))


def engine_bench_args(doc: str, argv: list[str] | None, add_args: Callable[[argparse.ArgumentParser], None],
                      parents: Sequence[argparse.ArgumentParser] = ()) -> tuple[argparse.Namespace, list[str]]:
    """(this bench's args, the model worker Config flags after `--`) for the benches that build
    an engine from the model worker's own flags; every one takes --batch-sizes. parents: flags a
    bench read before (so that --help lists them too)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=doc.splitlines()[0], parents=list(parents),
                                     epilog="Flags after -- go to the model worker's Config.")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 32])
    add_args(parser)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def alternate_decode_steps(engine, steps: int, modes: tuple[str, str],
                           set_mode: Callable[[str], None]) -> dict[str, list[float]]:
    """Seconds per engine step in each of two modes, switching every step so both see the same
    machine load and nearly the same contexts; then modes[0] again and the engine run dry.
    The requests are already added: 4 untimed steps cover their prefill and first decodes."""
    for _ in range(4):
        engine.step()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for step in range(steps):
        mode = modes[step % 2]
        set_mode(mode)
        start = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - start)
    set_mode(modes[0])
    while engine.has_work():
        engine.step()
    return times


def step_times_row(batch: int, times: dict[str, list[float]]) -> str:
    """A markdown row: batch, each mode's median / best step ms, second mode / first mode."""
    first, second = times
    med = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
    cells = " | ".join(f"{med[mode]:.1f} / {min(t) * 1e3:.1f}" for mode, t in times.items())
    return f"| {batch} | {cells} | {med[second] / med[first]:.2f}x |"
