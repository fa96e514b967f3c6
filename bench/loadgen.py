"""Load generator for any OpenAI-compatible server: a concurrency sweep or Poisson request rates.

Streams /v1/completions (or chat) with fixed-length random prompts and ignore_eos, times every
SSE chunk, and reports request/s, output tok/s, TTFT, TPOT and ITL (p50/p90/p99) as JSON + PNG.

    python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --concurrency 1,8,32 \
        --output-tokens 200 --json bench/results/tokenwire.json --plot bench/results/tokenwire.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import aiohttp

if __package__ in (None, ""):  # run as a file: python bench/loadgen.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.metrics import LevelSummary, RequestRecord, summarize  # noqa: E402
from bench.openai_stream import RequestSpec, client_session, stream_request  # noqa: E402
from bench.prompts import Prompt, make_prompts, tokenizer_or_default  # noqa: E402
from bench.report import build_report, save_report  # noqa: E402
from bench.workload import Level, Workload, add_workload_args, run_arrivals, workload_from_args  # noqa: E402


async def run_level(client: aiohttp.ClientSession, url: str, spec: RequestSpec, prompts: list[Prompt],
                    level: Level, seed: int = 0, count_text: Callable[[str], int] | None = None
                    ) -> list[RequestRecord]:
    """Sends the level's requests (prompts: its own, in order): at most `concurrency` at once, or
    at Poisson arrival times. count_text: see stream_request."""
    return await run_arrivals(level, seed, lambda index: stream_request(client, url, spec, prompts[index], count_text))


async def open_connections(client: aiohttp.ClientSession, base_url: str, count: int) -> None:
    """`count` idle keep-alive connections in the client's pool (concurrent GET /models), so a
    level starts as a client with a warm pool would: otherwise the first wave's TTFT also times
    opening connections while the server already runs the first arrivals (measured: with 31 new
    connections the gateway got 2 requests 9-15 ms after the wave started and the other 30 at
    32 ms, which then waited for the first 2's prefill step; with open ones, all 32 came at 12 ms)."""

    async def get_models() -> None:
        async with client.get(f"{base_url}/models") as reply:
            await reply.read()

    await asyncio.gather(*(get_models() for _ in range(count)))


async def discover_model(client: aiohttp.ClientSession, base_url: str) -> str:
    async with client.get(f"{base_url}/models") as reply:
        reply.raise_for_status()
        models = (await reply.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return models[0]["id"]


async def run_sweep(base_url: str, spec: RequestSpec, workload: Workload, pool: list[Prompt],
                    warmup_requests: int = 1, log=print, count_text: Callable[[str], int] | None = None
                    ) -> list[LevelSummary]:
    """Every level of the workload in turn, after warmup_requests short requests.

    pool: workload.pool_size prompts (each level takes its own slice)."""
    base_url = base_url.rstrip("/")
    url = base_url + spec.path
    # No timeouts: a 200-token CPU decode at 32 streams can take minutes.
    async with client_session() as client:
        if not spec.model:
            spec = RequestSpec(**{**asdict(spec), "model": await discover_model(client, base_url)})
        warm_spec = RequestSpec(**{**asdict(spec), "max_tokens": min(spec.max_tokens, 4)})
        warmup = workload.warmup_prompts(pool)
        for i in range(warmup_requests):
            record = await stream_request(client, url, warm_spec, warmup[i % len(warmup)])
            if record.error:
                raise RuntimeError(f"warm-up request to {url} failed: {record.error}")
        summaries = []
        for level in workload.levels():
            # A warm pool for every request that can be in flight at once (rate mode: the cap, or
            # each request), so no first request's TTFT pays for opening a connection.
            await open_connections(client, base_url, min(level.concurrency or level.num_requests, 256))
            cpu_before = time.process_time()
            records = await run_level(client, url, spec, level.prompts(pool), level, workload.seed, count_text)
            summary = summarize(records, level.concurrency, level.request_rate)
            summary.client_cpu_s = round(time.process_time() - cpu_before, 3)
            log(format_summary(summary))
            summaries.append(summary)
        return summaries


def format_summary(s: LevelSummary) -> str:
    where = f"concurrency {s.concurrency}" if s.request_rate is None else f"rate {s.request_rate:g}/s"

    def ms(dist: dict) -> str:
        return "-" if dist["p50"] is None else f"{dist['p50']:.1f}/{dist['p90']:.1f}/{dist['p99']:.1f}"

    line = (f"{where}: {s.completed}/{s.num_requests} ok, {s.request_throughput:.2f} req/s, "
            f"{s.output_throughput:.1f} out tok/s, TTFT p50/p90/p99 {ms(s.ttft_ms)} ms, "
            f"TPOT {ms(s.tpot_ms)} ms, ITL {ms(s.itl_ms)} ms")
    if s.client_cpu_s is not None:
        line += f", client CPU {s.client_cpu_s:.2f} s"
    if s.errors:
        line += f"; errors: {s.errors}"
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root")
    parser.add_argument("--model", default="", help="model name to send; default: the first of GET /models")
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                        help="ids: send token ids as the prompt (tokenwire, vLLM; completions only)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos, so every request makes exactly --output-tokens tokens")
    parser.add_argument("--extra-body", default="{}",
                        help="JSON merged into every request, e.g. llama-cpp-python's logit_bias")
    parser.add_argument("--tokenizer", default="",
                        help="tokenizer.json or model dir for the prompts; default: SmolLM2 (tokenwire's default model)")
    parser.add_argument("--warmup-requests", type=int, default=1)
    parser.add_argument("--label", default="server", help="name of this series in the report and plot")
    parser.add_argument("--json", dest="json_out", default="", help="write the report here")
    parser.add_argument("--plot", default="", help="write a PNG plot here")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    args.workload = workload_from_args(args, parser)
    try:
        args.extra = json.loads(args.extra_body)
    except ValueError as exc:
        parser.error(f"--extra-body is not JSON: {exc}")
    if not isinstance(args.extra, dict):
        parser.error("--extra-body must be a JSON object")
    if args.prompt_format == "ids" and args.api == "chat":
        parser.error("--prompt-format ids needs --api completions")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload: Workload = args.workload
    tokenizer = tokenizer_or_default(args.tokenizer)
    pool = make_prompts(tokenizer, workload.pool_size, workload.prompt_len, workload.seed)
    spec = RequestSpec(args.api, args.model, workload.output_tokens, args.ignore_eos, args.prompt_format,
                       args.extra)

    def count_text(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    try:
        summaries = asyncio.run(run_sweep(args.base_url, spec, workload, pool, args.warmup_requests,
                                          count_text=count_text))
    except (RuntimeError, aiohttp.ClientError) as exc:  # server down, no model, warm-up refused
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    report = build_report(args.label, "openai", {**asdict(workload), "base_url": args.base_url, "api": args.api,
                                                 "prompt_format": args.prompt_format,
                                                 "ignore_eos": args.ignore_eos, "extra_body": args.extra},
                          summaries)
    save_report(report, args.json_out, args.plot,
                f"{args.label}: prompt {workload.prompt_len}, output {workload.output_tokens} tokens")
    return 1 if any(s.failed for s in summaries) else 0


if __name__ == "__main__":
    raise SystemExit(main())
