"""What the int4 weights buy under --int4-small-batch: SmolLM2 engine decode step times with the
decoder layers' matmuls on kernels/int4_linear.cpp (GGUF Q4_1's scheme, 5 bits a weight) against
the same engine's bf16 weights (the packed bf16 kernel or oneDNN, whichever the engine's flags give
its other steps), side by side in one process.

One engine (the model worker's own build, from its flags, with --int4-small-batch added) runs
`--batch-size` greedy requests; after a warm-up its decode steps alternate between the two, so
both see the same machine load and nearly the same contexts. Prints median and best step times and
the ratio. Needs a CPU where the kernel builds (AVX512-VNNI).

    .venv/bin/python bench/bench_int4_linear.py --batch-sizes 1,4,8 -- --num-threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_packed_linear import linear_layers  # noqa: E402
from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.models.linear import INT4_KERNEL_MAX_TOKENS  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402


def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
    layers = [layer for layer in linear_layers(engine.runner.model) if layer.int4_blocks is not None]
    if not layers:
        raise SystemExit("no int4 weights: needs a CPU where kernels/int4_linear.cpp builds")
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        for layer in layers:
            layer.int4_max_tokens = INT4_KERNEL_MAX_TOKENS if mode == "int4" else 0

    return alternate_decode_steps(engine, steps, ("int4", "bf16"), set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | int4 step ms (median / best) | bf16 step ms (median / best) | "
                   "bf16 / int4 |", bench_batch, ["--int4-small-batch", "on"], INT4_KERNEL_MAX_TOKENS)


if __name__ == "__main__":
    main()
