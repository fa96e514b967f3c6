"""What the GGUF-format weights buy under --int4-small-batch: SmolLM2 engine decode step times with
the decoder layers' matmuls in Q4_1 (5 bits a weight) and its Q8_0 lm_head (8.5) on
kernels/gguf_linear.cpp against the same engine's bf16 weights (the packed bf16 kernel or oneDNN,
whichever the engine's flags give its other steps), side by side in one process.

One engine (the model worker's own build, from its flags, with --int4-small-batch added) runs
`--batch-size` greedy requests; after a warm-up its decode steps alternate between the two, so
both see the same machine load and nearly the same contexts. Prints median and best step times and
the ratio. Needs a CPU where the kernel builds (AVX512-VNNI).

    .venv/bin/python bench/bench_gguf_linear.py --batch-sizes 1,4,8 -- --num-threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_packed_linear import linear_layers  # noqa: E402
from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.models.linear import GGUF_KERNEL_MAX_TOKENS  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402


def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
    layers = [layer for layer in linear_layers(engine.runner.model) if layer.gguf_blocks is not None]
    if not layers:
        raise SystemExit("no GGUF-format weights: needs a CPU where kernels/gguf_linear.cpp builds")
    limits = [layer.gguf_max_tokens for layer in layers]
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        for layer, limit in zip(layers, limits, strict=True):
            layer.gguf_max_tokens = limit if mode == "gguf" else 0

    return alternate_decode_steps(engine, steps, ("gguf", "bf16"), set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | GGUF-format step ms (median / best) | bf16 step ms (median / best) | "
                   "bf16 / GGUF |", bench_batch, ["--int4-small-batch", "on"], GGUF_KERNEL_MAX_TOKENS)


if __name__ == "__main__":
    main()
