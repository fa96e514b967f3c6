"""The serving path alone: CPU per streamed token of the gateway, the detok worker and the client.

    python -m bench.serving_path --concurrency 32 --output-tokens 200 --waves 3 --step-ms 25

Starts the real gateway and detok worker in front of bench/stand_in_model_worker.py (no model:
it gives every running request one token per --step-ms, all in one TokenFrame, as the engine's
decode steps do), streams completions through the gateway with the load generator's client (this
process; `bench.loadgen`'s requests: random prompts as token ids, ignore_eos, usage in every chunk),
and reads the CPU each process spent from the first request to the last: the services' from
/proc's per-thread run times (ns), the client's own process time. On a 2-core host the real engine
keeps both cores busy and a profile of the gateway then mostly shows it waiting for a core; here
nothing competes, so the figures (and a py-spy of the gateway) show the path's own cost. Each
service's CPU per token is what the engine would lose to it, and more (issue 4's notes in README
measure the amplification).

The default --step-ms 25 is the real engine's decode step at 32 streams on the 2-core host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

from bench.loadgen import discover_model, open_connections, run_level
from bench.metrics import process_cpu_seconds, summarize
from bench.openai_stream import RequestSpec, client_session
from bench.prompts import make_prompts, tokenizer_or_default
from bench.stand_in_model_worker import stand_in_stack
from bench.workload import Workload


@dataclass
class ServingPathRun:
    concurrency: int
    output_tokens: int  # streamed tokens counted over the measured run
    wall_s: float
    tokens_per_s: float
    # microseconds of CPU per streamed token, each process whole (all its threads)
    gateway_us: float
    detok_worker_us: float
    stand_in_model_worker_us: float
    load_generator_us: float


async def run_once(base_url: str, pids: dict[str, int], workload: Workload, prompts: list,
                   timeout_s: float) -> ServingPathRun:
    """One closed-loop level of the workload, its CPU read around the requests alone (the client's
    connections are open before, as `bench.loadgen` opens them)."""
    (level,) = workload.levels()
    async with client_session() as client:
        spec = RequestSpec("completions", await discover_model(client, base_url), workload.output_tokens,
                           prompt_format="ids")
        await open_connections(client, base_url, level.concurrency)
        before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
        client_before = time.process_time()
        records = await asyncio.wait_for(
            run_level(client, base_url + spec.path, spec, level.prompts(prompts), level, workload.seed), timeout_s)
        client_cpu = time.process_time() - client_before
        after = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
    summary = summarize(records, level.concurrency)
    if summary.failed:
        raise RuntimeError(f"{summary.failed} of {summary.num_requests} requests failed: {summary.errors}")
    num_tokens = summary.total_output_tokens

    def per_token(seconds: float) -> float:
        return round(seconds / num_tokens * 1e6, 1)

    return ServingPathRun(level.concurrency, num_tokens, round(summary.duration_s, 2),
                          round(summary.output_throughput, 1), per_token(after["gateway"] - before["gateway"]),
                          per_token(after["detok_worker"] - before["detok_worker"]),
                          per_token(after["model_worker"] - before["model_worker"]), per_token(client_cpu))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--waves", type=int, default=3, help="requests per run: waves x concurrency")
    parser.add_argument("--rounds", type=int, default=1, help="measured runs, one after another")
    parser.add_argument("--step-ms", type=float, default=25.0, help="the stand-in model worker's step")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the stand-in sends a request's tokens every N steps, as the model worker's flag")
    parser.add_argument("--model", help="a model directory: whose tokenizer the stand-in serves; "
                                        "default: the model worker's default model")
    parser.add_argument("--json", dest="json_out", help="write the runs here")
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="one more gateway flag (repeatable), e.g. --gateway-arg=--request-timeout-s=0")
    return parser.parse_args(argv)


async def measure(args: argparse.Namespace, base_url: str, pids: dict[str, int]) -> list[ServingPathRun]:
    workload = Workload(prompt_len=args.prompt_len, output_tokens=args.output_tokens,
                        concurrency=(args.concurrency,), waves=args.waves)
    pool = make_prompts(tokenizer_or_default(args.model or ""), workload.pool_size, workload.prompt_len, workload.seed)
    # Far more than the stand-in's clock needs: a stalled stream fails the run instead of hanging it.
    timeout_s = 60 + 4 * args.waves * args.output_tokens * max(args.stream_interval, 1) * args.step_ms / 1e3
    # A first short level warms every path (the detok worker's tables, the gateway's first requests).
    warm = Workload(prompt_len=args.prompt_len, output_tokens=8, concurrency=(args.concurrency,), waves=1)
    await run_once(base_url, pids, warm, pool, timeout_s)
    runs = []
    for _ in range(args.rounds):
        run = await run_once(base_url, pids, workload, pool, timeout_s)
        print(f"{run.concurrency} streams, step {args.step_ms:g} ms, interval {args.stream_interval}: "
              f"{run.tokens_per_s} tok/s; CPU per token: gateway {run.gateway_us} us, detok worker "
              f"{run.detok_worker_us}, stand-in model worker {run.stand_in_model_worker_us}, "
              f"load generator {run.load_generator_us}", flush=True)
        runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stand_in_args = ["--step-ms", str(args.step_ms), "--stream-interval", str(args.stream_interval),
                     *(["--model", args.model] if args.model else [])]
    with stand_in_stack(stand_in_args, gateway_args=args.gateway_arg, timeout_s=120) as stack:
        pids = {service.name: service.process.pid for service in stack.services}
        runs = asyncio.run(measure(args, f"{stack.gateway_url}/v1", pids))
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"step_ms": args.step_ms, "stream_interval": args.stream_interval,
                       "runs": [asdict(run) for run in runs]}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
