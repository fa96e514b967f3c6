"""What --cpu-bf16-matmul kernels buys on steps of more than 8 tokens: SmolLM2 engine decode step
times with the linear layers on one of kernels/bf16_linear.cpp's matmuls for larger steps, on the
weights packed in 4-row blocks (`--kernel vdpbf16ps`: bf16_linear's dot products; `--kernel fma`:
bf16_linear_fma's float32 FMAs), vs on oneDNN's packed bf16 matmul, side by side in one process on
the same bf16 weights.

One engine (the model worker's own build with both copies kept: --bf16-small-batch, --cpu-bf16-matmul
onednn) runs `--batch-size` greedy requests; after a warm-up its decode steps alternate between the
two matmuls. Prints median and best step times and the ratio. Which kernel wins depends on the CPU
(see model_worker/models/linear.py); `--cpu-bf16-matmul auto` times them at startup.

    .venv/bin/python bench/bench_kernel_matmul.py --kernel vdpbf16ps --batch-sizes 16,32,64 -- --num-threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_packed_linear import linear_layers  # noqa: E402
from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.kernels import bf16_linear_module  # noqa: E402
from model_worker.models.linear import LARGE_STEP_KERNELS  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--kernel", choices=sorted(LARGE_STEP_KERNELS), default="vdpbf16ps",
                        help="which of bf16_linear's matmuls for larger steps to time against oneDNN's")
    args, rest = parser.parse_known_args(argv[:split])
    rest += argv[split:]
    label = f"{args.kernel} kernel"

    def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
        layers = linear_layers(engine.runner.model)
        kernel = bf16_linear_module()
        if kernel is None or any(layer.bf16_blocks is None for layer in layers):
            raise SystemExit("no packed bf16 weights: needs a CPU where kernels/bf16_linear.cpp builds")
        matmul = getattr(kernel, LARGE_STEP_KERNELS[args.kernel])
        for i in range(batch):
            engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

        def set_mode(mode: str) -> None:
            for layer in layers:
                layer.bf16_large = matmul if mode == label else None

        return alternate_decode_steps(engine, steps, (label, "oneDNN"), set_mode)

    run_step_bench(__doc__, rest, f"| batch | {label} step ms (median / best) | oneDNN step ms (median / best) | "
                   f"oneDNN / {args.kernel} |", bench_batch, ["--bf16-small-batch", "--cpu-bf16-matmul", "onednn"],
                   parents=[parser])


if __name__ == "__main__":
    main()
