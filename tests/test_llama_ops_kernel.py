"""The Llama layers' compiled bf16 ops (model_worker/kernels/llama_ops.cpp: RMSNorm, residual
add + RMSNorm, rotary embedding + KV cache write, the MLP's silu(gate) * up) against llama.py's
torch ops.

Skipped where it cannot be used: a CPU without AVX512-BF16 or no C++ compiler; the model then
runs the torch ops, which the rest of the suite covers. Where both are there, a kernel that fails
to build fails these tests instead of skipping them.
"""

from __future__ import annotations

import pytest
import torch

from model_worker import kernels, model_runner
from model_worker.kv_cache import PagedKVCache
from model_worker.model_runner import ModelRunner
from model_worker.models import llama
from tests.tiny_hf_models import PROMPTS, engine_greedy

CAN_BUILD = kernels.can_build({"avx512f", "avx512_bf16"})
module = kernels.llama_ops_module()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no AVX512-BF16 CPU or no C++ compiler here")
EPS = 1e-5


def test_the_kernel_builds_where_it_can():
    assert (module is not None) == CAN_BUILD


def _rows(num_rows: int, hidden: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The only difference allowed: the float32 sum of squares taken in another order, which may
    move an element across one bf16 rounding boundary."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - expected.float()).abs() <= ulp).all()
    assert (got != expected).sum().item() <= 0.01 * got.numel()


@needs_kernel
@pytest.mark.parametrize("hidden", [576, 64, 100, 4096], ids=["smollm2", "one-vector-multiple", "masked-tail", "8b"])
@pytest.mark.parametrize("num_rows", [0, 1, 3, 70], ids=["empty", "decode", "few", "parallel-rows"])
def test_matches_the_torch_ops(hidden, num_rows):
    x, delta = _rows(num_rows, hidden, 1, 4.0), _rows(num_rows, hidden, 2)
    weight = _rows(1, hidden, 3)[0]
    _assert_within_one_rounding(module.rms_norm(x, weight, EPS), llama.rms_norm(x, weight, EPS))
    x_sum, h = module.add_rms_norm(x, delta, weight, EPS)
    expected_sum, expected_h = llama.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(x_sum, expected_sum)  # the same single bf16 rounding of the add
    _assert_within_one_rounding(h, expected_h)
    assert torch.equal(x, _rows(num_rows, hidden, 1, 4.0))  # inputs left as they were


@needs_kernel
def test_a_non_finite_row_only_spoils_itself():
    x = _rows(3, 576, 4)
    x[1, 9] = float("nan")
    x[2, 3] = float("inf")
    weight = _rows(1, 576, 5)[0]
    h = module.rms_norm(x, weight, EPS)
    assert h[1].isnan().all() and not h[0].isnan().any()
    expected = llama.rms_norm(x, weight, EPS)
    assert torch.equal(h[2].isnan(), expected[2].isnan())
    _assert_within_one_rounding(h[:1], expected[:1])


@needs_kernel
def test_subnormals_round_as_torch_rounds():
    # VCVTNEPS2BF16 would flush these to zero; torch's casts keep them.
    weight = torch.ones(64, dtype=torch.bfloat16)
    x, delta = _rows(2, 64, 12), _rows(2, 64, 13)
    x[0, 0], delta[0, 0] = 3e-38, -2.5e-38  # an add that cancels to a subnormal
    x[1] = torch.full((64,), 1e-39).bfloat16()  # a row of subnormals, normed back up
    x_sum, h = module.add_rms_norm(x, delta, weight, EPS)
    expected_sum, expected_h = llama.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(x_sum, expected_sum) and x_sum[0, 0] != 0
    _assert_within_one_rounding(h, expected_h)
    _assert_within_one_rounding(module.rms_norm(x, weight, EPS), llama.rms_norm(x, weight, EPS))


@needs_kernel
def test_refuses_what_it_was_not_built_for():
    x, weight = _rows(2, 64, 6), _rows(1, 64, 7)[0]
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.rms_norm(x.float(), weight, EPS)
    with pytest.raises(RuntimeError, match="contiguous"):
        module.rms_norm(_rows(64, 2, 8).t(), weight, EPS)
    with pytest.raises(RuntimeError, match="weight"):
        module.rms_norm(x, weight[:32], EPS)
    with pytest.raises(RuntimeError, match="delta"):
        module.add_rms_norm(x, x[:1], weight, EPS)


@needs_kernel
def test_the_llama_forward_uses_them_on_bf16_and_scores_prompts_like_the_torch_ops(head_dim_64_model_dir,
                                                                                    tiny_model_dir, monkeypatch):
    def runner(layer_ops: bool, dtype: torch.dtype = torch.bfloat16, model_dir=head_dim_64_model_dir):
        # Only the layer ops switch: the paged decode attention kernel runs in both.
        with monkeypatch.context() as patch:
            if not layer_ops:
                patch.setattr(model_runner, "llama_ops_module", lambda build_root: None)
            return ModelRunner(model_dir, "dummy", torch.device("cpu"), dtype, 8, 64, kv_cache_tokens=512)

    with_kernel, torch_ops = runner(True), runner(False)
    assert with_kernel.kv_cache.decode_kernel is not None and torch_ops.kv_cache.decode_kernel is not None
    assert with_kernel.model.add_rms_norm is module.add_rms_norm
    assert with_kernel.model.rope_and_cache is module.rope_and_cache
    assert with_kernel.model.act_and_mul is module.silu_and_mul
    assert torch_ops.model.add_rms_norm is llama.add_rms_norm and torch_ops.model.rope_and_cache is None
    assert torch_ops.model.act_and_mul is llama.silu_and_mul
    assert runner(True, torch.float32).model.rope_and_cache is None
    narrow_heads = runner(True, model_dir=tiny_model_dir).model  # 16-wide heads: norms only
    assert narrow_heads.add_rms_norm is module.add_rms_norm and narrow_heads.rope_and_cache is None
    # Teacher-forced prompt logprobs over every layer's norms (a prefill in 10-token chunks, so
    # several rows a call), and the decode rows after them: no greedy split can hide a bad norm.
    prompt = PROMPTS[0]
    got, expected = (engine_greedy(r, [prompt], max_tokens=3, step_budget=10, prompt_logprobs=0)[0]
                     for r in (with_kernel, torch_ops))
    got_prompt, expected_prompt = got[0].prompt_logprobs.logprobs[1:], expected[0].prompt_logprobs.logprobs[1:]
    assert len(got_prompt) == len(expected_prompt) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(got_prompt, expected_prompt, strict=True)) < 0.05
    assert got[0].token_id == expected[0].token_id


@needs_kernel
@pytest.mark.parametrize("intermediate", [1536, 16, 50], ids=["smollm2", "one-vector", "masked-tail"])
@pytest.mark.parametrize("num_rows", [0, 1, 40], ids=["empty", "decode", "parallel-rows"])
def test_silu_and_mul_matches_the_torch_ops(intermediate, num_rows):
    """torch's silu runs Sleef's expf; the kernel's own exp is within a float32 ulp or two of it,
    so an element may land one bf16 step away, rarely."""
    gate_up = _rows(num_rows, 2 * intermediate, 20, 4.0)
    _assert_within_one_rounding(module.silu_and_mul(gate_up), llama.silu_and_mul(gate_up))


@needs_kernel
def test_silu_and_mul_at_the_edges_of_exp():
    # Gates from where exp(-g) overflows (silu -> -0.0) to where it underflows (silu -> g),
    # subnormal products, and non-finite values, each as torch leaves them.
    gates = torch.tensor([-1e30, -200.0, -100.0, -89.0, -88.5, -87.0, -20.0, -1e-3, -0.0, 0.0, 1e-38, 1e-3, 20.0,
                          87.0, 88.5, 89.0, 100.0, 200.0, 3e38, float("inf"), float("-inf"), float("nan")])
    ups = torch.full_like(gates, 1.5)
    ups[10] = 1e-3  # 1e-38 * 1e-3: a subnormal product
    gate_up = torch.cat([gates, ups])[None].bfloat16()
    got, expected = module.silu_and_mul(gate_up), llama.silu_and_mul(gate_up)
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(expected[finite]))  # -0.0 where torch has it


@needs_kernel
def test_silu_and_mul_refuses_odd_widths_and_other_dtypes():
    with pytest.raises(RuntimeError, match="gate_up"):
        module.silu_and_mul(_rows(2, 7, 21))
    with pytest.raises(RuntimeError, match="gate_up"):
        module.silu_and_mul(_rows(2, 8, 21).float())
    with pytest.raises(RuntimeError, match="gate_up"):
        module.silu_and_mul(_rows(8, 4, 21).t())


def _rope_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).bfloat16()
    qkv[:1, :head_dim] = 0.0  # a zero head: -0.0 where torch's neg gives it, which 0 - x would not
    angles = torch.randn(256, head_dim // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    positions = torch.randint(0, 256, (num_tokens,), generator=gen)
    cache = PagedKVCache(1, 8, 16, num_kv_heads, head_dim, torch.bfloat16, torch.device("cpu"))
    slots = torch.randperm(8 * 16, generator=gen)[:num_tokens]
    return qkv, positions, cos, sin, cache, slots


def _torch_rope_and_cache(qkv, positions, cos, sin, cache, slots, num_heads, num_kv_heads, head_dim):
    """llama.py's torch path for the same step."""
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(len(positions), num_heads + num_kv_heads, head_dim)
    c, s = cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]
    qk = qk * c + llama.rotate_half(qk) * s
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(len(positions), num_kv_heads, head_dim)
    cache.write(0, slots, qk[:, num_heads:], v)
    return qk


@needs_kernel
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 40], ids=["empty", "decode", "few", "parallel-tokens"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (32, 8, 128)], ids=["smollm2", "mha-32", "8b"])
def test_rope_and_cache_is_bitwise_the_torch_path(num_tokens, heads):
    num_heads, num_kv_heads, head_dim = heads
    qkv, positions, cos, sin, cache, slots = _rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, seed=10)
    reference_cache = PagedKVCache(1, 8, 16, num_kv_heads, head_dim, torch.bfloat16, torch.device("cpu"))
    expected = _torch_rope_and_cache(qkv, positions, cos, sin, reference_cache, slots, *heads)
    got = module.rope_and_cache(qkv, positions, cos, sin, cache.key[0], cache.value[0], slots, num_heads, num_kv_heads)
    assert got.shape == expected.shape and torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(cache.key, reference_cache.key) and torch.equal(cache.value, reference_cache.value)
    assert cache.key.any() == (num_tokens > 0)  # the write happened (the caches start at zero)


@needs_kernel
def test_rope_and_cache_refuses_bad_slots_positions_and_shapes():
    qkv, positions, cos, sin, cache, slots = _rope_inputs(2, 9, 3, 64, seed=11)
    args = (cos, sin, cache.key[0], cache.value[0])
    with pytest.raises(RuntimeError, match="slot 128 outside"):
        module.rope_and_cache(qkv, positions, *args, torch.tensor([0, 128]), 9, 3)
    with pytest.raises(RuntimeError, match="position 256 outside"):
        module.rope_and_cache(qkv, torch.tensor([0, 256]), *args, slots, 9, 3)
    with pytest.raises(RuntimeError, match="qkv must be"):
        module.rope_and_cache(qkv, positions, *args, slots, 8, 3)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        small = PagedKVCache(1, 8, 16, 3, 48, torch.bfloat16, torch.device("cpu"))
        module.rope_and_cache(qkv[:, :15 * 48].contiguous(), positions, cos[:, :48].contiguous(),
                              sin[:, :48].contiguous(), small.key[0], small.value[0], slots, 9, 3)
    assert not cache.key.any()  # nothing written by a refused call
