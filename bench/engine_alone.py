"""tokenwire's LLMEngine alone (no gRPC, no detok, no gateway) under loadgen's workload and metrics.

The engine is built from the model worker's own Config and flags, as model_worker/__main__.py
builds it, so `serving / engine` tok/s at the same flags is the serving path's cost as a ratio.

    python -m bench.engine_alone --concurrency 1,32 --output-tokens 200 --json bench/results/engine.json \
        -- --max-num-seqs 32 --max-model-len 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/engine_alone.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.loadgen import format_summary  # noqa: E402
from bench.metrics import LevelSummary, RequestRecord, summarize  # noqa: E402
from bench.prompts import Prompt, load_tokenizer, make_prompts  # noqa: E402
from bench.report import build_report, save_report  # noqa: E402
from bench.workload import Level, Workload, add_workload_args, arrival_offsets, workload_from_args  # noqa: E402
from model_worker.__main__ import build_engine as build_model_worker_engine  # noqa: E402
from model_worker.config import Config  # noqa: E402
from model_worker.engine import LLMEngine, RequestRejected  # noqa: E402
from model_worker.sequence import FinishReason, SamplingParams  # noqa: E402
from tokenwire.config_cli import parse_config  # noqa: E402
from tokenwire.gc_heap import freeze_startup_heap  # noqa: E402


def build_engine(config: Config) -> tuple[LLMEngine, Path]:
    """The engine exactly as the model worker builds it from the same Config."""
    engine, model_dir, _, _ = build_model_worker_engine(config)
    return engine, model_dir


class EngineDriver:
    """Runs levels on one engine: adds requests between steps, as the model worker's loop does,
    and stamps each output token with the time its step returned."""

    def __init__(self, engine: LLMEngine, output_tokens: int, ignore_eos: bool = True,
                 sampling: SamplingParams | None = None) -> None:
        self.engine = engine
        self.output_tokens = output_tokens
        self.ignore_eos = ignore_eos
        self.sampling = sampling or SamplingParams()  # greedy, as loadgen's temperature 0
        self._next_id = 0

    def _add(self, prompt: Prompt, max_tokens: int) -> int:
        request_id = self._next_id
        self._next_id += 1
        self.engine.add_request(request_id, prompt.token_ids, self.sampling, max_tokens, [], self.ignore_eos)
        return request_id

    def warm_up(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            self._add(prompt, min(self.output_tokens, 4))
        while self.engine.has_work():
            self.engine.step()

    def run_level(self, prompts: list[Prompt], level: Level, seed: int = 0) -> list[RequestRecord]:
        """Closed loop (at most level.concurrency in flight) or Poisson arrivals, like loadgen."""
        offsets = (arrival_offsets(level.num_requests, level.request_rate, seed) if level.request_rate
                   else [0.0] * level.num_requests)
        cap = level.concurrency or level.num_requests
        records = [RequestRecord(start=0.0, num_prompt_tokens=len(p.token_ids)) for p in prompts]
        waiting = deque(range(len(prompts)))
        live: dict[int, int] = {}  # engine request id -> index in prompts
        level_start = time.perf_counter()
        cap_freed_at = level_start  # when the in-flight cap last had room again
        while waiting or live:
            now = time.perf_counter()
            while waiting and len(live) < cap and level_start + offsets[waiting[0]] <= now:
                index = waiting.popleft()
                # Arrivals: loadgen sends on time, and the request waits in the server for the step
                # then running; here it is seen only after that step, so it starts at its scheduled
                # time (or when the cap let it in), not now.
                records[index].start = (max(level_start + offsets[index], cap_freed_at) if level.request_rate
                                        else now)
                try:
                    live[self._add(prompts[index], self.output_tokens)] = index
                except RequestRejected as exc:
                    records[index].error, records[index].end = f"rejected: {exc.message}", now
            if not live:  # idle until the next arrival
                if waiting:
                    time.sleep(max(0.0, level_start + offsets[waiting[0]] - time.perf_counter()))
                continue
            if not self.engine.has_work():  # would loop forever: the engine lost requests
                for index in live.values():
                    records[index].error, records[index].end = "the engine dropped the request", now
                for index in waiting:  # never sent: not a start of 0, which would span the machine's uptime
                    records[index].start = records[index].end = now
                    records[index].error = "not sent: the engine dropped the requests before it"
                break
            outputs = self.engine.step()
            step_end = time.perf_counter()
            for out in outputs:
                index = live.get(out.seq_id)
                if index is None:
                    continue
                record = records[index]
                if out.token_id is not None:
                    record.add_chunk(step_end, 1)
                if out.finish_reason != FinishReason.NONE:
                    record.end = step_end
                    record.num_output_tokens = out.num_output_tokens
                    if out.finish_reason == FinishReason.ERROR:
                        record.error = "engine reported FINISH_REASON_ERROR"
                    del live[out.seq_id]
                    if len(live) == cap - 1:
                        cap_freed_at = step_end
        return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Flags after -- go to the model worker's Config (python -m model_worker --help).")
    parser.add_argument("--label", default="tokenwire engine alone")
    parser.add_argument("--json", dest="json_out", default="")
    parser.add_argument("--plot", default="")
    parser.add_argument("--sampling", type=json.loads, default={},
                        help='SamplingParams fields as JSON, e.g. \'{"temperature": 1.0, "top_p": 0.95}\' '
                             "(what loadgen's --extra-body sends); default: greedy")
    return parse_with_model_worker_args(parser, argv)


def parse_with_model_worker_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The bench's flags (the parser's, plus the workload's), with the model worker flags after
    `--` as args.model_worker_args and the Workload as args.workload."""
    add_workload_args(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.model_worker_args = argv[split + 1:]
    args.workload = workload_from_args(args, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload: Workload = args.workload
    config = parse_config(Config, args.model_worker_args, env_prefix="TOKENWIRE_MODEL_WORKER_")
    if config.max_num_seqs < workload.max_in_flight:
        print(f"note: --max-num-seqs {config.max_num_seqs} < {workload.max_in_flight} requests in flight; "
              "the engine queues the rest", file=sys.stderr)
    engine, model_dir = build_engine(config)
    pool = make_prompts(load_tokenizer(model_dir), workload.pool_size, workload.prompt_len, workload.seed)
    driver = EngineDriver(engine, workload.output_tokens, sampling=SamplingParams(**args.sampling))
    driver.warm_up(workload.warmup_prompts(pool)[:1])
    freeze_startup_heap("engine alone")  # as the model worker does once it has built its engine
    summaries: list[LevelSummary] = []
    for level in workload.levels():
        summary = summarize(driver.run_level(level.prompts(pool), level, workload.seed),
                            level.concurrency, level.request_rate)
        print(format_summary(summary), flush=True)
        summaries.append(summary)
    runner = engine.runner
    report = build_report(args.label, "engine", {**asdict(workload), "model_worker_args": args.model_worker_args},
                          summaries, dtype=str(runner.dtype).removeprefix("torch."), device=str(runner.device))
    save_report(report, args.json_out, args.plot,
                f"{args.label}: prompt {workload.prompt_len}, output {workload.output_tokens} tokens")
    return 1 if any(s.failed for s in summaries) else 0


if __name__ == "__main__":
    raise SystemExit(main())
