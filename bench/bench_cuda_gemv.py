"""Decode-step matmuls on CUDA: torch's F.linear (cuBLAS) vs triton_ops.small_batch_linear over a few
tile shapes, at 1-8 rows, for the Llama-3-8B projections (qkv, o, gate_up, down, lm_head), bf16.
Times are do_bench medians (L2 flushed between runs); GB/s counts the weight bytes read.

    python -m bench.bench_cuda_gemv --rows 1,4
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from model_worker.triton_ops import small_batch_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 128, 4, 6), (64, 128, 4, 4), (16, 512, 4, 3), (32, 512, 8, 3),
           (64, 256, 8, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4")
    args = parser.parse_args()
    device = torch.device("cuda")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            weight = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            want = F.linear(x, weight).float()
            cublas = triton.testing.do_bench(lambda x=x, weight=weight: F.linear(x, weight), return_mode="median")
            results = []
            for config in CONFIGS:
                got = small_batch_linear(x, weight, *config).float()
                error = float((got - want).abs().max() / want.abs().max())
                ms = triton.testing.do_bench(lambda x=x, weight=weight, config=config: small_batch_linear(x, weight, *config),
                                             return_mode="median")
                results.append((ms, config, error))
            best = min(results)
            gbs = lambda ms, n=n, k=k: n * k * 2 / ms / 1e6  # noqa: E731
            print(f"rows {rows} {name:8s} [{n}x{k}]: cuBLAS {cublas * 1e3:7.1f} us ({gbs(cublas):6.0f} GB/s); triton best "
                  f"{best[0] * 1e3:7.1f} us ({gbs(best[0]):6.0f} GB/s) {best[1]} rel err {best[2]:.1e}; "
                  f"ratio {cublas / best[0]:.2f}x; all: " + " ".join(f"{r[0] * 1e3:.0f}" for r in results), flush=True)


if __name__ == "__main__":
    main()
