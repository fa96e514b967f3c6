"""What the C++ bf16 norms buy (kernels/rms_norm.cpp: RMSNorm fused with the residual add before
it): SmolLM2 engine decode step times with the Llama forward's norms on the kernel vs on torch
ops, side by side in one process.

One engine (the model worker's own build, from its flags, bf16) runs `--batch-size` greedy
requests; after a warm-up its decode steps alternate between the two, so both see the same
machine load and nearly the same contexts. Prints median and best step times and the ratio.
Needs a CPU where the kernel builds (AVX512-BF16).

    .venv/bin/python bench/bench_rms_norm.py --batch-sizes 1,32 -- --num-threads 2
    .venv/bin/python bench/bench_rms_norm.py --batch-sizes 1 -- --num-threads 2 --int8-small-batch
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.models import llama  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402


def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
    model = engine.runner.model
    kernel = (model.rms_norm, model.add_rms_norm)
    if kernel[1] is llama.add_rms_norm:
        raise SystemExit("the model runs torch norms: needs a Llama-family model in bf16 on a CPU where "
                         "kernels/rms_norm.cpp builds")
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        model.rms_norm, model.add_rms_norm = kernel if mode == "kernel" else (llama.rms_norm, llama.add_rms_norm)

    return alternate_decode_steps(engine, steps, ("kernel", "torch ops"), set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | kernel norms step ms (median / best) | torch-op norms step ms "
                   "(median / best) | torch / kernel |", bench_batch)


if __name__ == "__main__":
    main()
