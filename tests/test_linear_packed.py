"""bf16 CPU linear layers run on weights pre-packed for oneDNN, bitwise equal to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_worker.models.linear import BATCH_INVARIANT_ROW_TILE, Linear, pack_for_onednn

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 32, 100])
def test_packed_bf16_linear_is_bitwise_f_linear(num_tokens, with_bias):
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(320, 192, generator=gen).bfloat16()
    bias = torch.randn(320, generator=gen).bfloat16() if with_bias else None
    layer = Linear(weight, bias)
    assert layer.packed_weight is not None and layer.packed_weight.is_mkldnn
    assert layer.weight is None  # one copy of the weights in memory, not two
    assert torch.equal(layer.packed_weight.to_dense(), weight)
    x = torch.randn(num_tokens, 192, generator=gen).bfloat16()
    got = layer(x)
    assert got.shape == (num_tokens, 320) and got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x, weight, bias))
    # A strided view (GPT-2 slices its fused qkv output) gives the same answer.
    wide = torch.randn(num_tokens, 384, generator=gen).bfloat16()
    assert torch.equal(layer(wide[:, :192]), F.linear(wide[:, :192], weight, bias))


def test_float32_and_batch_invariant_layers_keep_plain_gemms():
    # oneDNN's float32 GEMM differs from MKL's in the last bits, and batch-invariant mode was
    # validated on F.linear's fixed-shape tiles.
    assert pack_for_onednn(torch.randn(8, 8)) is None
    assert Linear(torch.randn(8, 8)).packed_weight is None
    assert Linear(torch.randn(8, 8).bfloat16(), row_tile=BATCH_INVARIANT_ROW_TILE).packed_weight is None
