"""tokenwire's model worker over gRPC alone (no gateway, no detok, no HTTP) under loadgen's workload.

The middle point between `bench.engine_alone` (the engine in-process) and `bench.loadgen` through the
gateway: requests go as `AddRequest`s on one `ModelWorker.Generate` stream, as the gateway sends
them (every request multiplexed on it), and each token counts when its `TokenFrame` is read. So
`model worker / engine alone` is what the model worker's serving costs (its event loop, framing and
gRPC beside the engine's steps), and `gateway / model worker` what the gateway, the detok worker and
the HTTP client cost on top.

    python -m bench.model_worker_direct --model-worker 127.0.0.1:50051 --concurrency 1,32 \
        --output-tokens 200 --json bench/results/model_worker.json

The prompts are token ids made with the model's tokenizer (--tokenizer, default: the default
model's). `bench.side_by_side --systems tokenwire,model_worker,engine` starts a model worker alone
for it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/model_worker_direct.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.loadgen import format_summary  # noqa: E402
from bench.metrics import LevelSummary, RequestRecord, summarize  # noqa: E402
from bench.prompts import Prompt, make_prompts, tokenizer_or_default  # noqa: E402
from bench.report import build_report, save_report  # noqa: E402
from bench.workload import Level, Workload, add_workload_args, run_arrivals, workload_from_args  # noqa: E402
from tokenwire.grpc_server import CHANNEL_OPTIONS  # noqa: E402
from tokenwire.v1 import model_worker_pb2 as pb  # noqa: E402
from tokenwire.v1 import model_worker_pb2_grpc as pb_grpc  # noqa: E402


class GenerateStreamDriver:
    """One Generate stream: adds requests as a level's arrivals come and stamps each token with the
    time its frame was read. A request id is a counter, so levels and warm-ups never collide."""

    def __init__(self, call, output_tokens: int, ignore_eos: bool = True) -> None:
        self.call = call
        self.output_tokens = output_tokens
        self.ignore_eos = ignore_eos
        self._ids = itertools.count()
        self._live: dict[str, tuple[RequestRecord, asyncio.Event]] = {}
        self._writing = asyncio.Lock()  # a stream takes one write at a time (grpc: TOO_MANY_OPERATIONS)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frame = await self.call.read()
            if frame is grpc.aio.EOF:
                break
            now = time.perf_counter()
            for seq in frame.sequences:
                found = self._live.get(seq.request_id)
                if found is None:
                    continue
                record, done = found
                record.add_chunk(now, len(seq.token_ids) // 4)
                if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    record.end = now
                    record.num_output_tokens = seq.num_output_tokens
                    if seq.finish_reason == pb.FINISH_REASON_ERROR:
                        record.error = f"FINISH_REASON_ERROR: {seq.error.message}"
                    elif seq.finish_reason == pb.FINISH_REASON_ABORT:
                        record.error = "aborted by the model worker"
                    del self._live[seq.request_id]
                    done.set()
        ended = time.perf_counter()
        for record, done in self._live.values():  # the stream ended under them
            record.error = record.error or "the Generate stream ended"
            record.end = ended  # not 0, which would span the machine's uptime
            done.set()
        self._live.clear()

    async def request(self, prompt: Prompt, max_tokens: int) -> RequestRecord:
        request_id = f"direct-{next(self._ids)}"
        record = RequestRecord(start=time.perf_counter(), num_prompt_tokens=len(prompt.token_ids))
        done = asyncio.Event()
        self._live[request_id] = (record, done)
        if self._reader.done():
            record.error, record.end = "the Generate stream ended", time.perf_counter()
            return record
        async with self._writing:
            await self.call.write(pb.RequestFrame(adds=[pb.AddRequest(
                request_id=request_id, prompt_token_ids=prompt.token_ids, max_tokens=max_tokens,
                ignore_eos=self.ignore_eos)]))
        await done.wait()
        return record

    async def run_level(self, prompts: list[Prompt], level: Level, seed: int = 0) -> list[RequestRecord]:
        """Closed loop (at most level.concurrency in flight) or Poisson arrivals, like loadgen."""
        return await run_arrivals(level, seed, lambda index: self.request(prompts[index], self.output_tokens))

    async def close(self) -> None:
        async with self._writing:
            await self.call.done_writing()
        await self._reader


async def run_sweep(address: str, workload: Workload, pool: list[Prompt], ignore_eos: bool = True,
                    log=print) -> tuple[list[LevelSummary], pb.ModelInfo]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.ModelWorkerStub(channel)
        # A worker still loading its model is waited for (up to the timeout), not refused.
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=300, wait_for_ready=True)
        driver = GenerateStreamDriver(stub.Generate(), workload.output_tokens, ignore_eos)
        warm = await driver.request(workload.warmup_prompts(pool)[0], min(workload.output_tokens, 4))
        if warm.error:
            raise RuntimeError(f"warm-up request to {address} failed: {warm.error}")
        summaries = []
        for level in workload.levels():
            summary = summarize(await driver.run_level(level.prompts(pool), level, workload.seed),
                                level.concurrency, level.request_rate)
            log(format_summary(summary))
            summaries.append(summary)
        await driver.close()
        return summaries, info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-worker", default="127.0.0.1:50051", help="the model worker's gRPC address")
    parser.add_argument("--tokenizer", default="", help="the model's tokenizer directory (tokenizer.json); "
                                                        "default: the default model's")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--label", default="tokenwire model worker over gRPC")
    parser.add_argument("--json", dest="json_out", default="")
    parser.add_argument("--plot", default="")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    args.workload = workload_from_args(args, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload: Workload = args.workload
    tokenizer = tokenizer_or_default(args.tokenizer)
    pool = make_prompts(tokenizer, workload.pool_size, workload.prompt_len, workload.seed)
    summaries, info = asyncio.run(run_sweep(args.model_worker, workload, pool, args.ignore_eos))
    report = build_report(args.label, "model_worker", {**asdict(workload), "model_worker": args.model_worker},
                          summaries, dtype=info.dtype, device=info.device)
    save_report(report, args.json_out, args.plot,
                f"{args.label}: prompt {workload.prompt_len}, output {workload.output_tokens} tokens")
    return 1 if any(s.failed for s in summaries) else 0


if __name__ == "__main__":
    raise SystemExit(main())
