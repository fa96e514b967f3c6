"""TTFT that the gateway and the detok worker add (issue 4: at most 2 ms at p50).

The same kind of request, one at a time and alternating, goes through the gateway's OpenAI API
(streamed completion over HTTP, prompt as token ids) and straight to the model worker's Generate
stream (token-in/token-out gRPC, what another service would call). Both see an idle engine when
they arrive, so the difference of their TTFTs is what the serving path in front of the model worker
costs: HTTP parsing and validation, the gateway's gRPC hop to the model worker, the first token's
round trip through the detok worker, and the SSE write. Every request has its own random prompt,
so none is served from the prefix cache.

    python -m bench.ttft_added --requests 60 --threads 2
    python -m bench.ttft_added --base-url http://HOST:8000/v1 --model-worker HOST:50051
    python -m bench.ttft_added --stand-in --rounds 3

Without --base-url it starts the stack on the default model (as `bench.side_by_side` does).
With --stand-in the model worker is bench/stand_in_model_worker.py (no model, a step every
--step-ms): both paths then see the same model worker with no torch competing for the cores, so
what HTTP adds is the serving path's own latency. On a host with few cores the engine's threads
keep every core busy, and the serving path's work waits for one: the stack's figure is both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.openai_stream import RequestSpec, client_session, stream_request
from bench.prompts import Prompt, load_tokenizer, make_prompts
from model_worker.config import DEFAULT_CACHE_DIR
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc as pb_grpc


@dataclass
class TTFTAdded:
    """Seconds, one entry per measured request of each path (warm-up dropped), in send order."""

    http: list[float]
    grpc: list[float]

    def summary(self) -> dict[str, float]:
        """p50 / p90 of each path in ms, and what the HTTP path adds: the difference of the
        medians and the median of the paired differences (request i over HTTP minus request i over
        gRPC, sent back to back, so a slow second on the machine hits both)."""
        pairs = [h - g for h, g in zip(self.http, self.grpc, strict=True)]
        return {
            "requests_per_path": len(self.http),
            "http_p50_ms": _ms(statistics.median(self.http)),
            "http_p90_ms": _ms(_p90(self.http)),
            "grpc_p50_ms": _ms(statistics.median(self.grpc)),
            "grpc_p90_ms": _ms(_p90(self.grpc)),
            "added_p50_ms": _ms(statistics.median(self.http) - statistics.median(self.grpc)),
            "added_paired_p50_ms": _ms(statistics.median(pairs)),
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _p90(values: Sequence[float]) -> float:
    """numpy's (linear) 90th percentile, as bench.metrics and vLLM take percentiles."""
    import numpy as np

    return float(np.percentile(values, 90))


class GenerateClient:
    """One request at a time on its own Generate stream, so every frame read is this request's."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._call = pb_grpc.ModelWorkerStub(self._channel).Generate()

    async def ttft(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> float:
        """Seconds from writing the add to reading its first token; then reads to its end."""
        began = time.perf_counter()
        await self._call.write(pb.RequestFrame(adds=[pb.AddRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens, ignore_eos=True)]))
        first: float | None = None
        while True:
            frame = await self._call.read()
            if frame is grpc.aio.EOF:
                raise RuntimeError(f"the Generate stream ended before {request_id} did")
            for seq in frame.sequences:
                if seq.request_id != request_id:
                    continue
                if seq.finish_reason == pb.FINISH_REASON_ERROR:
                    raise RuntimeError(f"{request_id} failed: {seq.error.message}")
                if first is None and seq.token_ids:
                    first = time.perf_counter() - began
                if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    if first is None:
                        raise RuntimeError(f"{request_id} ended without a token")
                    return first

    async def close(self) -> None:
        await self._call.done_writing()
        await self._channel.close()


async def measure(base_url: str, model_worker: str, prompts: Sequence[Prompt], max_tokens: int,
                  gap_s: float, warmup: int, model: str | None = None, id_prefix: str = "ttft") -> TTFTAdded:
    """len(prompts) // 2 pairs; pair i sends prompts[2i] over HTTP and prompts[2i+1] over gRPC,
    in alternating order, with gap_s of idle between requests; the first `warmup` pairs are
    not kept."""
    result = TTFTAdded([], [])
    generate = GenerateClient(model_worker)
    try:
        async with client_session() as session:
            if model is None:
                async with session.get(f"{base_url}/models") as response:
                    model = (await response.json())["data"][0]["id"]
            spec = RequestSpec("completions", model, max_tokens, prompt_format="ids")
            url = f"{base_url}{spec.path}"

            async def over_http(prompt: Prompt) -> float:
                record = await stream_request(session, url, spec, prompt)
                if not record.ok:
                    raise RuntimeError(f"HTTP request failed: {record.error}")
                return record.ttft

            for i in range(len(prompts) // 2):
                http_prompt, grpc_prompt = prompts[2 * i], prompts[2 * i + 1]
                if i % 2 == 0:
                    http_s = await over_http(http_prompt)
                    await asyncio.sleep(gap_s)
                    grpc_s = await generate.ttft(f"{id_prefix}-{i}", grpc_prompt.token_ids, max_tokens)
                else:
                    grpc_s = await generate.ttft(f"{id_prefix}-{i}", grpc_prompt.token_ids, max_tokens)
                    await asyncio.sleep(gap_s)
                    http_s = await over_http(http_prompt)
                await asyncio.sleep(gap_s)
                if i >= warmup:
                    result.http.append(http_s)
                    result.grpc.append(grpc_s)
    finally:
        await generate.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="the gateway's OpenAI API root; default: start the stack")
    parser.add_argument("--model-worker", help="the model worker's gRPC address (with --base-url)")
    parser.add_argument("--requests", type=int, default=60, help="measured requests per path")
    parser.add_argument("--warmup", type=int, default=5, help="pairs sent first and not kept")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8,
                        help="max_tokens: with more than 1 the engine is decoding while the first token travels")
    parser.add_argument("--gap-ms", type=float, default=30.0, help="idle time between requests")
    parser.add_argument("--threads", type=int, help="model worker threads (when starting the stack; default 2)")
    parser.add_argument("--tokenwire-args", default="", help="extra model worker flags (when starting the stack)")
    parser.add_argument("--stand-in", action="store_true",
                        help="a model worker with no model (bench/stand_in_model_worker.py) instead of the engine")
    parser.add_argument("--step-ms", type=float, help="the stand-in's step (with --stand-in; default 1)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the model the stack serves (the stand-in: its tokenizer), whose tokenizer makes the prompts")
    parser.add_argument("--rounds", type=int, default=1, help="measured runs on the same stack, one after another")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    if bool(args.base_url) != bool(args.model_worker):
        parser.error("--base-url and --model-worker go together")
    if args.base_url and (args.stand_in or args.threads is not None or args.tokenwire_args):
        parser.error("--stand-in, --threads and --tokenwire-args are for the stack it starts: not with --base-url")
    if args.stand_in and (args.threads is not None or args.tokenwire_args):
        parser.error("--threads and --tokenwire-args are the model worker's: not with --stand-in")
    if args.step_ms is not None and not args.stand_in:
        parser.error("--step-ms is the stand-in's: only with --stand-in")
    if args.requests < 1 or args.warmup < 0 or args.output_tokens < 1 or args.rounds < 1:
        parser.error("--requests, --output-tokens and --rounds must be at least 1, --warmup at least 0")

    model_dir = resolve_model_dir(args.model, DEFAULT_CACHE_DIR)
    # Every round has prompts (and request ids) of its own: a second round on the same prompts would
    # find them in the prefix cache.
    tokenizer = load_tokenizer(model_dir)
    rounds = [dict(prompts=make_prompts(tokenizer, 2 * (args.requests + args.warmup), args.prompt_len, seed=7 + r),
                   max_tokens=args.output_tokens, gap_s=args.gap_ms / 1e3, warmup=args.warmup, id_prefix=f"ttft{r}")
              for r in range(args.rounds)]
    results: list[TTFTAdded] = []
    if args.base_url:
        results = [asyncio.run(measure(args.base_url, args.model_worker, **run)) for run in rounds]
    else:
        from bench.stand_in_model_worker import stand_in_stack
        from tokenwire.stack import start_stack

        if args.stand_in:
            mw_args = ["--step-ms", str(args.step_ms or 1.0), "--model", str(model_dir)]
            module, launch = "bench.stand_in_model_worker", stand_in_stack
        else:
            # --generation-config vllm: the direct gRPC path sends no model defaults, so the gateway adds none.
            mw_args = ["--model", args.model, "--max-num-seqs", "8", "--generation-config", "vllm",
                       "--max-model-len", str(args.prompt_len + args.output_tokens + 16),
                       "--num-threads", str(args.threads or 2), *shlex.split(args.tokenwire_args)]
            module, launch = "model_worker", start_stack
        print(f"$ python -m tokenwire.stack ({module}) -- {shlex.join(mw_args)}", flush=True)
        with launch(mw_args) as stack:
            results = [asyncio.run(measure(f"{stack.gateway_url}/v1", stack.model_worker_address, **run))
                       for run in rounds]
    summaries = [result.summary() for result in results]
    for summary in summaries:
        print(f"TTFT p50 over HTTP (gateway + detok) {summary['http_p50_ms']:.2f} ms, straight to the model "
              f"worker {summary['grpc_p50_ms']:.2f} ms: added {summary['added_p50_ms']:.2f} ms "
              f"(paired p50 {summary['added_paired_p50_ms']:.2f} ms); p90 {summary['http_p90_ms']:.2f} "
              f"vs {summary['grpc_p90_ms']:.2f} ms; {summary['requests_per_path']} requests per path")
    if args.json_out:
        args.json_out.write_text(json.dumps({"rounds": [{"summary": summary, "ttft_s": asdict(result)}
                                                        for summary, result in zip(summaries, results, strict=True)],
                                             "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
