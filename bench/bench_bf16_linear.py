"""What the C++ bf16 matmul buys under --bf16-small-batch: SmolLM2 engine decode step times with
the linear layers on kernels/bf16_linear.cpp (weights packed in 4-row blocks) vs on oneDNN's packed
bf16 matmul (the path without the flag), side by side in one process on the same bf16 weights.

One engine (the model worker's own build, from its flags, with --bf16-small-batch added) runs
`--batch-size` greedy requests; after a warm-up its decode steps alternate between the two
matmuls, so both see the same machine load and nearly the same contexts. Prints median and best
step times and the ratio. Needs a CPU where the kernel builds (AVX512-BF16).

    .venv/bin/python bench/bench_bf16_linear.py --batch-sizes 1,2,4,8 -- --num-threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_packed_linear import linear_layers  # noqa: E402
from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.models.linear import BF16_KERNEL_MAX_TOKENS  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402


def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
    layers = linear_layers(engine.runner.model)
    if any(layer.bf16_blocks is None for layer in layers):
        raise SystemExit("no packed bf16 weights: needs a CPU where kernels/bf16_linear.cpp builds")
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        for layer in layers:
            layer.bf16_max_tokens = BF16_KERNEL_MAX_TOKENS if mode == "kernel" else 0

    return alternate_decode_steps(engine, steps, ("kernel", "oneDNN"), set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | bf16 kernel step ms (median / best) | oneDNN step ms (median / best) | "
                   "oneDNN / kernel |", bench_batch, ["--bf16-small-batch", "--cpu-bf16-matmul", "onednn"],
                   BF16_KERNEL_MAX_TOKENS)


if __name__ == "__main__":
    main()
