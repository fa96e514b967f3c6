"""Why the model worker builds its engine on the thread that steps it: decode tokens/s and CPU
cores busy with the engine built on the main thread vs on the stepping thread, steps always on
one executor thread as the model worker runs them (no gRPC).

Each mode runs in its own process (an OpenMP team, once a thread has one, lasts as long as the
thread), modes alternating for --rounds rounds; prints one markdown row per run.

    .venv/bin/python bench/bench_engine_thread.py --batch-sizes 1,32 -- --num-threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.workload import engine_bench_args  # noqa: E402

MODES = ("main thread", "stepping thread")


def run_one(mode: str, batch: int, tokens: int, worker_args: list[str]) -> dict:
    """In this process: build (where `mode` says), then time `batch` greedy requests stepped on
    the executor thread. Prints nothing; returns the figures."""
    from model_worker.__main__ import build_engine
    from model_worker.config import Config
    from model_worker.engine_loop import new_engine_thread
    from model_worker.sequence import SamplingParams
    from tokenwire.config_cli import parse_config

    config = parse_config(Config, argv=["--max-num-seqs", str(batch), "--max-model-len", str(32 + tokens + 16),
                                        *worker_args])
    engine_thread = new_engine_thread()
    engine = (build_engine(config) if mode == "main thread"
              else engine_thread.submit(build_engine, config).result())[0]

    def level(num_tokens: int, first_id: int) -> tuple[float, float]:
        for i in range(batch):
            engine.add_request(first_id + i, list(range(100 + i, 132 + i)), SamplingParams(), num_tokens, [], True)
        start, cpu_start = time.perf_counter(), sum(os.times()[:2])
        while engine.has_work():
            engine_thread.submit(engine.step).result()
        wall = time.perf_counter() - start
        return batch * num_tokens / wall, (sum(os.times()[:2]) - cpu_start) / wall

    level(4, 0)  # warm-up
    tok_s, cores = level(tokens, 10_000)
    return {"mode": mode, "batch": batch, "tok_s": tok_s, "cores": cores}


def main(argv: list[str] | None = None) -> None:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tokens", type=int, default=100, help="decode tokens per request")
        parser.add_argument("--rounds", type=int, default=2)
        parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: mode,batch of a child run

    args, worker_args = engine_bench_args(__doc__, argv, add_args)
    if args.one:
        mode, batch = args.one.rsplit(",", 1)
        print(json.dumps(run_one(mode, int(batch), args.tokens, worker_args)))
        return
    print("| batch | engine built on | decode tok/s | CPU cores busy |")
    print("|---|---|---|---|")
    for batch in args.batch_sizes:
        for _ in range(args.rounds):
            for mode in MODES:
                child = subprocess.run(
                    [sys.executable, __file__, "--one", f"{mode},{batch}", "--tokens", str(args.tokens), "--",
                     *worker_args], capture_output=True, text=True, check=True)
                result = json.loads(child.stdout.strip().splitlines()[-1])
                print(f"| {batch} | {mode} | {result['tok_s']:.1f} | {result['cores']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
