"""The optional weight-only int8 copy of linear layers used for small CPU steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_worker.model_runner import ModelRunner
from model_worker.models.linear import INT8_MAX_TOKENS, Linear, quantize_int8_per_channel


def test_per_channel_int8_round_trips_within_half_a_step():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    quantized, scales = quantize_int8_per_channel(weight)
    assert quantized.dtype == torch.int8 and scales.shape == (64,)
    restored = quantized.float() * scales.float()[:, None]
    # Half a quantisation step, plus the bf16 rounding of the scale itself.
    assert ((restored - weight.float()).abs() <= scales.float()[:, None] * 0.51 + 1e-2).all()


def test_small_steps_use_int8_and_large_steps_the_exact_bf16_weights():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 128, generator=gen).bfloat16()
    bias = torch.randn(256, generator=gen).bfloat16()
    layer = Linear(weight, bias, int8_small_batch=True)
    small = torch.randn(INT8_MAX_TOKENS, 128, generator=gen).bfloat16()
    large = torch.randn(INT8_MAX_TOKENS + 1, 128, generator=gen).bfloat16()
    exact_small = F.linear(small, weight, bias).float()
    got_small = layer(small).float()
    assert not torch.equal(got_small, exact_small)  # the int8 path ran
    assert (got_small - exact_small).abs().max() < 0.05 * exact_small.abs().max()
    assert torch.equal(layer(large), F.linear(large, weight, bias))


@pytest.mark.parametrize(("n", "k", "rows"), [(6, 40, 1), (96, 100, 1), (64, 72, 2)])
def test_torchs_int8_op_is_not_used_where_k_is_not_a_multiple_of_32(n, k, rows):
    # torch 2.13's _weight_int8pack_mm crashed the process on these shapes, or returned values
    # near 1e36 ([96, 100] at one row): such a layer keeps no int8 copy and runs its small steps
    # in bf16, exactly.
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    layer = Linear(weight, int8_small_batch=True)
    assert layer.int8_weight is None and layer.int8_max_tokens == 0
    x = torch.randn(rows, k, generator=gen).bfloat16()
    assert torch.equal(layer(x), F.linear(x, weight))
    assert Linear(torch.randn(n, 64, generator=gen).bfloat16(), int8_small_batch=True).int8_max_tokens == INT8_MAX_TOKENS


def test_int8_needs_cpu_bf16_weights():
    with pytest.raises(ValueError, match="bfloat16"):
        Linear(torch.randn(4, 4), int8_small_batch=True)


def test_model_logits_with_int8_small_steps_stay_close_to_bf16(tiny_model_dir):
    plain = ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.bfloat16, 2, 64, kv_cache_tokens=128)
    int8 = ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.bfloat16, 2, 64, kv_cache_tokens=128,
                       int8_small_batch=True)
    hidden = torch.randn(1, plain.shape.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    a, b = plain.model.logits(hidden), int8.model.logits(hidden)
    assert a.shape == b.shape and not torch.equal(a, b)
    assert torch.nn.functional.cosine_similarity(a, b).item() > 0.999
