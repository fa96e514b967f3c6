"""What the Llama layers' C++ bf16 ops buy (kernels/llama_ops.cpp: RMSNorm fused with the residual
add before it, rotary embedding with the KV cache write, the MLP's silu(gate) * up): SmolLM2 engine
decode step times with the Llama forward on those ops vs on torch ops, side by side in one process.

One engine (the model worker's own build, from its flags, bf16) runs `--batch-size` greedy
requests; after a warm-up its decode steps alternate between the two, so both see the same
machine load and nearly the same contexts. Prints median and best step times and the ratio.
Needs a CPU where the kernel builds (AVX512-BF16).

    .venv/bin/python bench/bench_llama_ops.py --batch-sizes 1,32 -- --num-threads 2
    .venv/bin/python bench/bench_llama_ops.py --batch-sizes 1 -- --num-threads 2 --int8-small-batch
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
    kernel = (model.rms_norm, model.add_rms_norm, model.rope_and_cache, model.silu_and_mul)
    if kernel[1] is llama.add_rms_norm:
        raise SystemExit("the model runs torch ops: needs a Llama-family model in bf16 on a CPU where "
                         "kernels/llama_ops.cpp builds")
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        model.rms_norm, model.add_rms_norm, model.rope_and_cache, model.silu_and_mul = (
            kernel if mode == "kernel" else (llama.rms_norm, llama.add_rms_norm, None, llama.silu_and_mul))

    return alternate_decode_steps(engine, steps, ("kernel", "torch ops"), set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | C++ layer ops step ms (median / best) | torch ops step ms "
                   "(median / best) | torch / C++ |", bench_batch)


if __name__ == "__main__":
    main()
