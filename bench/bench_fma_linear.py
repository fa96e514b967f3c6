"""What --cpu-bf16-matmul kernels buys on steps of more than 8 tokens: SmolLM2 engine decode step
times with the linear layers on kernels/bf16_linear.cpp's float32-FMA matmul (bf16_linear_fma, on
the weights packed in 4-row blocks) vs on oneDNN's packed bf16 matmul, side by side in one process
on the same bf16 weights.

One engine (the model worker's own build with both copies kept: --bf16-small-batch, --cpu-bf16-matmul
onednn) runs `--batch-size` greedy requests; after a warm-up its decode steps alternate between the
two matmuls. Prints median and best step times and the ratio. The FMA kernel wins where VDPBF16PS,
which oneDNN's bf16 GEMM runs on, is slow (see model_worker/models/linear.py).

    .venv/bin/python bench/bench_fma_linear.py --batch-sizes 16,32,64 -- --num-threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_packed_linear import linear_layers  # noqa: E402
from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.kernels import bf16_linear_module  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402


def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
    layers = linear_layers(engine.runner.model)
    kernel = bf16_linear_module()
    if kernel is None or any(layer.bf16_blocks is None for layer in layers):
        raise SystemExit("no packed bf16 weights: needs a CPU where kernels/bf16_linear.cpp builds")
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        for layer in layers:
            layer.bf16_fma = kernel.bf16_linear_fma if mode == "FMA kernel" else None

    return alternate_decode_steps(engine, steps, ("FMA kernel", "oneDNN"), set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | FMA kernel step ms (median / best) | oneDNN step ms (median / best) | "
                   "oneDNN / FMA kernel |", bench_batch, ["--bf16-small-batch", "--cpu-bf16-matmul", "onednn"])


if __name__ == "__main__":
    main()
