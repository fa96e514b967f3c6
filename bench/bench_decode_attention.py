"""What the C++ paged decode attention buys: SmolLM2 engine decode step times with the kernel
(model_worker/kernels, `--cpu-decode-kernel`) vs the torch-ops path, side by side in one process.

One engine (the model worker's own build, from its flags) runs `--batch-size` greedy requests
with `--prompt-len`-token prompts; after a warm-up its decode steps alternate between the kernel
and torch ops, so both see the same machine load and nearly the same context lengths. Prints
median and best step times and the ratio. Needs a CPU with AVX512-BF16 and a compiler.

    .venv/bin/python bench/bench_decode_attention.py --batch-sizes 1,32 --prompt-len 128 -- --num-threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.workload import alternate_decode_steps, engine_bench_args, step_times_row  # noqa: E402
from model_worker.__main__ import build_engine  # noqa: E402
from model_worker.config import Config  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402
from tokenwire.config_cli import parse_config  # noqa: E402


def bench_batch(engine, batch: int, prompt_len: int, steps: int, base_id: int) -> dict[str, list[float]]:
    kv = engine.runner.kv_cache
    kernel = kv.decode_kernel
    for i in range(batch):
        prompt = [100 + (i + j) % 1000 for j in range(prompt_len)]
        engine.add_request(base_id + i, prompt, SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        kv.decode_kernel = kernel if mode == "kernel" else None

    return alternate_decode_steps(engine, steps, ("kernel", "torch"), set_mode)


def main(argv: list[str] | None = None) -> None:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=60, help="timed decode steps per batch size (half each mode)")
        parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (the contexts attention reads)")

    args, worker_args = engine_bench_args(__doc__, argv, add_args)
    batches = args.batch_sizes
    config = parse_config(Config, argv=["--max-num-seqs", str(max(batches)), "--max-model-len",
                                        str(args.prompt_len + args.steps + 16), "--dtype", "bfloat16", *worker_args])
    engine, _, _, _ = build_engine(config)
    if engine.runner.kv_cache.decode_kernel is None:
        raise SystemExit("no decode kernel here: it needs bf16 on an AVX512-BF16 CPU with a compiler")
    print(f"prompt {args.prompt_len} tokens, contexts {args.prompt_len}-{args.prompt_len + args.steps + 4}")
    print("| batch | kernel step ms (median / best) | torch ops step ms (median / best) | torch / kernel |")
    print("|---|---|---|---|")
    for n, batch in enumerate(batches):
        print(step_times_row(batch, bench_batch(engine, batch, args.prompt_len, args.steps, n * 10_000)), flush=True)


if __name__ == "__main__":
    main()
