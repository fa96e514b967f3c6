"""What the C++ int8 matmul buys under --int8-small-batch: SmolLM2 engine decode step times with
the int8 linear layers on kernels/int8_linear.cpp (packed 4-row blocks) vs on torch's
_weight_int8pack_mm (plain int8 rows), side by side in one process on the same int8 weights.

One engine (the model worker's own build, from its flags, with --int8-small-batch added) runs
`--batch-size` greedy requests; after a warm-up its decode steps alternate between the two
matmuls, so both see the same machine load and nearly the same contexts. Prints median and best
step times and the ratio. Batch sizes above 4 time the kernel against bf16 GEMMs instead (torch's
op is only used up to 4 rows). Needs a CPU where the kernel builds (AVX512-VNNI).

    .venv/bin/python bench/bench_int8_linear.py --batch-sizes 1,2,4,8 -- --num-threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_packed_linear import linear_layers  # noqa: E402
from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.models.linear import INT8_KERNEL_MAX_TOKENS, INT8_MAX_TOKENS  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402


def unpack_row_blocks(packed: torch.Tensor, num_rows: int, num_cols: int) -> torch.Tensor:
    """pack_row_blocks's inverse: [ceil(N/4), Kp/32, 4, 32] -> [N, K]."""
    blocks, col_blocks, rows, cols = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * rows, col_blocks * cols)[:num_rows, :num_cols].contiguous()


def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
    layers = linear_layers(engine.runner.model)
    if any(layer.int8_weight is None or layer.int8_weight.dim() != 4 for layer in layers):
        raise SystemExit("no kernel-packed int8 weights: needs a CPU where kernels/int8_linear.cpp builds")
    kernel = [(layer.int8_weight, layer.int8_matmul, layer.int8_max_tokens) for layer in layers]
    if batch <= INT8_MAX_TOKENS:
        other = []
        for layer, (weight, _, _) in zip(layers, kernel, strict=True):
            num_cols = (layer.packed_weight if layer.packed_weight is not None else layer.weight).size(1)
            plain = unpack_row_blocks(weight, layer.int8_scales.numel(), num_cols)
            other.append((plain, torch.ops.aten._weight_int8pack_mm, INT8_MAX_TOKENS))
    else:  # above torch's int8 range the alternative is the bf16 weights
        other = [(w, matmul, 0) for w, matmul, _ in kernel]
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)

    def set_mode(mode: str) -> None:
        for layer, (weight, matmul, max_tokens) in zip(layers, kernel if mode == "kernel" else other, strict=True):
            layer.int8_weight, layer.int8_matmul, layer.int8_max_tokens = weight, matmul, max_tokens

    return alternate_decode_steps(engine, steps, ("kernel", "torch op" if batch <= INT8_MAX_TOKENS else "bf16"),
                                  set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | int8 kernel step ms (median / best) | other step ms (median / best) | "
                   "other / kernel |", bench_batch, ["--int8-small-batch"], INT8_KERNEL_MAX_TOKENS)


if __name__ == "__main__":
    main()
