"""main() shared by the benches that time an engine's decode steps alternating between two modes
(bench_packed_linear.py, bench_int8_linear.py, bench_bf16_linear.py, bench_llama_ops.py):
--batch-sizes and --steps, the model worker's flags after `--`, one bf16 engine, one markdown row
per batch size."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from bench.workload import engine_bench_args, step_times_row
from model_worker.__main__ import build_engine
from model_worker.config import Config
from tokenwire.config_cli import parse_config

# (engine, batch size, timed steps, first request id) -> seconds per step by mode
BenchBatch = Callable[[object, int, int, int], dict[str, list[float]]]


def run_step_bench(doc: str, argv: list[str] | None, header: str, bench_batch: BenchBatch,
                   worker_flags: Sequence[str] = (), max_batch: int = 0,
                   parents: Sequence[argparse.ArgumentParser] = ()) -> None:
    """header: the table's first line (batch, the two modes, the ratio); worker_flags: Config
    flags this bench always needs; max_batch > 0: the largest batch size it can time; parents:
    the bench's own flags, read before (engine_bench_args)."""
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=60, help="timed decode steps per batch size (half each mode)")

    args, worker_args = engine_bench_args(doc, argv, add_args, parents)
    batches = args.batch_sizes
    if max_batch and max(batches) > max_batch:
        raise SystemExit(f"--batch-sizes: at most {max_batch} here")
    config = parse_config(Config, argv=["--max-num-seqs", str(max(batches)), "--max-model-len",
                                        str(32 + args.steps + 16), "--dtype", "bfloat16", *worker_flags,
                                        *worker_args])
    engine, _, _, _ = build_engine(config)
    print(header)
    print("|---|---|---|---|")
    for n, batch in enumerate(batches):
        print(step_times_row(batch, bench_batch(engine, batch, args.steps, n * 10_000)), flush=True)
