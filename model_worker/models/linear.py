"""A linear layer's weights, with an optional weight-only int8 copy for small steps on CPU.

At one to a few tokens a step reads every weight once and does little math, so it is bound by
memory bandwidth: int8 weights (per output channel scales, torch's _weight_int8pack_mm) halve
the bytes of bf16 and measured 2-3x faster at 1 token on this project's CPUs. From about 8
tokens on, bf16 GEMMs (AVX512-BF16) win, so larger steps keep using the bf16 weights; the
int8 copy costs half the bf16 weights' memory again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Steps of at most this many tokens use the int8 copy (crossover measured near 8 tokens).
INT8_MAX_TOKENS = 4


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], scales [N] in weight's dtype), symmetric per row."""
    w32 = weight.float()
    scales = w32.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    quantized = torch.round(w32 / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.contiguous(), scales.to(weight.dtype)


def int8_small_batch_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


class Linear:
    """y [T, N] = x [T, K] @ weight [N, K]^T (+ bias)."""

    __slots__ = ("weight", "bias", "int8_weight", "int8_scales")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, int8_small_batch: bool = False):
        self.weight = weight
        self.bias = bias
        self.int8_weight = self.int8_scales = None
        if int8_small_batch:
            if not int8_small_batch_supported(weight):
                raise ValueError("int8 small-batch weights need bfloat16 weights on the CPU")
            self.int8_weight, self.int8_scales = quantize_int8_per_channel(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_weight is not None and x.shape[0] <= INT8_MAX_TOKENS:
            y = torch.ops.aten._weight_int8pack_mm(x, self.int8_weight, self.int8_scales)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
