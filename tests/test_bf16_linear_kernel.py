"""The compiled bf16 matmuls on weights packed in 4-row blocks (model_worker/kernels/bf16_linear.cpp:
--bf16-small-batch, --cpu-bf16-matmul kernels).

Skipped where it cannot be used: a CPU without AVX512-BF16 or no C++ compiler; the model then keeps
oneDNN's matmul for every step. Where both are there, a kernel that fails to build fails these
tests instead of skipping them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_worker import kernels
from model_worker.config import Config
from model_worker.model_runner import ModelRunner
from model_worker.models.linear import (
    BF16_KERNEL_MAX_TOKENS,
    LARGE_STEP_KERNELS,
    Linear,
    kernel_matmul_times,
    pack_row_blocks,
)

CAN_BUILD = kernels.can_build({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
module = kernels.bf16_linear_module()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no AVX512-BF16 CPU or no C++ compiler here")
# Rows across the 4-row groups' tails, a group's full count, the switch from streaming block by block
# to panels (over 16), and the 128-row chunks of x.
ROWS = [0, 1, 2, 3, 4, 5, 7, 9, 16, 17, 33, 127, 128, 129, 300]


def test_the_kernel_builds_where_it_can():
    assert (module is not None) == CAN_BUILD


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _bound(x: torch.Tensor, weight: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """The bf16 output's rounding (2^-9 relative, taken as 2^-8) plus float32 sums of K products
    (each exact in float32; K roundings of 2^-24 relative to the running sum's magnitude)."""
    magnitude = x.double().abs() @ weight.double().abs().t()
    return exact.abs() / 256 + x.shape[1] * 2.0 ** -23 * magnitude


@needs_kernel
# Output tiles are 8 blocks (32 columns): 70 and 1000 end in partial ones.
@pytest.mark.parametrize("n,k", [(576, 576), (960, 576), (576, 1536), (6, 40), (33, 100), (5, 8), (70, 96), (1000, 64)],
                         ids=["square", "qkv", "down", "padded-both", "odd", "under-one-column-block", "partial-tile",
                              "many-tiles"])
@pytest.mark.parametrize("m", ROWS)
def test_matches_the_float64_matmul(n, k, m):
    weight, x, bias = _bf16(n, k, seed=n * 7 + k), _bf16(m, k, seed=m), _bf16(n, seed=n)
    packed = pack_row_blocks(weight)
    got = module.bf16_linear(x, packed, n, k)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    if m == 0:
        return
    exact = x.double() @ weight.double().t()
    assert ((got.double() - exact).abs() <= _bound(x, weight, exact)).all()
    # oneDNN's bf16 matmul on the same weights: the two differ only in the order of float32 sums.
    assert (got.double() - F.linear(x, weight).double()).abs().max() <= 2 * exact.abs().max() / 256
    # The bias is added in float32, before the one rounding to bf16.
    with_bias = module.bf16_linear(x, packed, n, k, bias).double()
    exact_with_bias = exact + bias.double()
    assert ((with_bias - exact_with_bias).abs() <= _bound(x, weight, exact_with_bias)).all()


@needs_kernel
@pytest.mark.parametrize("matmul", ["bf16_linear", "bf16_linear_fma"])
def test_a_rows_output_does_not_depend_on_the_rest_of_the_step(matmul):
    # The soak replays requests in other batches and expects the same tokens: a row's sums must not
    # change with the step's size (streamed, panels, 128-row chunks) or its place in a 4-row group.
    n, k = 200, 576
    weight, bias = _bf16(n, k, seed=21), _bf16(n, seed=22)
    packed, run = pack_row_blocks(weight), getattr(module, matmul)
    x = _bf16(300, k, seed=23)
    whole = run(x, packed, n, k, bias)
    slices = [(0, 1), (5, 3), (6, 9), (130, 17), (1, 299)]
    for start, rows in slices:
        assert torch.equal(run(x[start:start + rows], packed, n, k, bias), whole[start:start + rows])
    # Random values rarely land where another order of sums rounds to another bf16; these always
    # do. Against a weight of ones, float lanes 0, 2 and 8 of the first column chunk hold 2^25,
    # -2^25 and 1: lanes 0 and 2 first give 1 (the kernel's order), lanes 0 and 8 first lose the 1.
    x = torch.zeros(300, k)
    x[:, 0], x[:, 4], x[:, 16] = 2.0 ** 25, -(2.0 ** 25), 1.0
    ones = pack_row_blocks(torch.ones(8, k).bfloat16())
    for start, rows in slices:
        assert (run(x[start:start + rows].bfloat16(), ones, 8, k) == 1).all()


@needs_kernel
def test_a_non_contiguous_x_is_read_as_its_values():
    weight = _bf16(64, 96, seed=1)
    x = _bf16(96, 3, seed=2).t()  # [3, 96], column-major
    assert torch.equal(module.bf16_linear(x, pack_row_blocks(weight), 64, 96),
                       module.bf16_linear(x.contiguous(), pack_row_blocks(weight), 64, 96))


@needs_kernel
def test_zero_rows_stay_zero_and_a_non_finite_row_only_spoils_itself():
    weight = _bf16(64, 96, seed=3)
    x = _bf16(4, 96, seed=4)
    x[1] = 0
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    got = module.bf16_linear(x, pack_row_blocks(weight), 64, 96)
    assert torch.equal(got[1], torch.zeros(64, dtype=torch.bfloat16))
    assert got[2].isnan().all()
    assert not got[3].isfinite().any()  # +-inf, or NaN where inf meets a zero weight
    exact = x[:1].double() @ weight.double().t()
    assert ((got[0].double() - exact).abs() <= _bound(x[:1], weight, exact)).all()


@needs_kernel
def test_columns_past_k_are_not_read_from_the_next_row():
    # K = 40: the last 32-column load of a row covers 8 of its columns; without the mask it would
    # take 24 of the next row's (times the weights' zero padding: 0, unless they are inf or NaN)
    # and, on the last row, read past the end of x.
    weight = _bf16(8, 40, seed=13)
    x = _bf16(2, 40, seed=14)
    x[1, :24] = float("inf")
    got = module.bf16_linear(x, pack_row_blocks(weight), 8, 40)
    exact = x[:1].double() @ weight.double().t()
    assert got[0].isfinite().all() and ((got[0].double() - exact).abs() <= _bound(x[:1], weight, exact)).all()


@needs_kernel
def test_refuses_what_it_was_not_built_for():
    weight = _bf16(8, 64, seed=5)
    packed = pack_row_blocks(weight)
    x = _bf16(1, 64, seed=6)
    assert module.bf16_linear(_bf16(40, 64, seed=7), packed, 8, 64).shape == (40, 8)  # no row limit
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        module.bf16_linear(_bf16(1, 96, seed=8), packed, 8, 64)
    with pytest.raises(RuntimeError, match="x has 50 columns, the weight 64"):
        module.bf16_linear(_bf16(1, 50, seed=8), packed, 8, 64)  # fewer, within the packed padding
    with pytest.raises(RuntimeError, match="in_features is 96"):
        module.bf16_linear(_bf16(1, 96, seed=8), packed, 8, 96)
    with pytest.raises(RuntimeError, match="out_features"):
        module.bf16_linear(x, packed, 3, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.bf16_linear(x.float(), packed, 8, 64)
    with pytest.raises(RuntimeError, match="packed"):
        module.bf16_linear(x, weight, 8, 64)  # the plain [N, K] rows
    with pytest.raises(RuntimeError, match="packed"):
        module.bf16_linear(x, packed.float(), 8, 64)
    with pytest.raises(RuntimeError, match="bias"):
        module.bf16_linear(x, packed, 8, 64, _bf16(7, seed=9))
    with pytest.raises(RuntimeError, match="bias"):
        module.bf16_linear(x, packed, 8, 64, torch.zeros(8))


@needs_kernel
def test_linear_uses_the_kernel_up_to_its_row_limit_and_onednn_beyond():
    weight, bias = _bf16(96, 64, seed=9), _bf16(96, seed=10)
    layer = Linear(weight, bias, bf16_kernel=module)
    plain = Linear(weight, bias)
    assert layer.bf16_blocks.shape == (24, 2, 4, 32)
    for rows in range(1, BF16_KERNEL_MAX_TOKENS + 3):
        x = _bf16(rows, 64, seed=rows)
        got = layer(x)
        if rows <= BF16_KERNEL_MAX_TOKENS:
            assert torch.equal(got, module.bf16_linear(x, layer.bf16_blocks, 96, 64, bias))
            exact = x.double() @ weight.double().t() + bias.double()
            assert ((got.double() - exact).abs() <= _bound(x, weight, exact)).all()
        else:
            assert torch.equal(got, plain(x))
    assert layer(torch.zeros(0, 64).bfloat16()).shape == (0, 96)


def test_linear_refuses_a_bf16_copy_it_cannot_use():
    stub = object()  # never called: each of these is refused before any packing
    with pytest.raises(ValueError, match="bfloat16 weights on the CPU"):
        Linear(torch.randn(8, 8), bf16_kernel=stub)
    with pytest.raises(ValueError, match="int8 / GGUF small-batch"):
        Linear(torch.randn(8, 8).bfloat16(), int8_small_batch=True, bf16_kernel=stub)
    with pytest.raises(ValueError, match="batch-invariant"):
        Linear(torch.randn(8, 8).bfloat16(), row_tile=16, bf16_kernel=stub)


@pytest.mark.parametrize("other", [{"int8_small_batch": True}, {"batch_invariant": True}, {"dtype": "float32"},
                                   {"device": "cuda"}], ids=["int8", "batch-invariant", "float32", "cuda"])
def test_config_refuses_the_flag_with_paths_it_does_not_serve(other):
    with pytest.raises(ValueError, match="--bf16-small-batch"):
        Config(bf16_small_batch=True, **other)


@needs_kernel
def test_model_runner_builds_its_layers_on_the_kernel(tiny_model_dir):
    def runner(**kwargs) -> ModelRunner:
        return ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.bfloat16, 2, 64, kv_cache_tokens=128,
                           **kwargs)

    with_kernel, without = runner(bf16_small_batch=True), runner()
    assert with_kernel.model.lm_head.bf16_blocks is not None and without.model.lm_head.bf16_blocks is None
    assert all(layer["qkv"].bf16_blocks is not None for layer in with_kernel.model.layers)
    # --cpu-decode-kernel off takes the kernel away with the others: oneDNN for every step.
    assert runner(bf16_small_batch=True, cpu_decode_kernel=False).model.lm_head.bf16_blocks is None
    hidden = _bf16(3, with_kernel.shape.hidden_size, seed=11)
    a, b = with_kernel.model.logits(hidden).float(), without.model.logits(hidden).float()
    assert not torch.equal(a, b)  # the kernel ran: its sums are ordered unlike oneDNN's
    assert F.cosine_similarity(a, b).min().item() > 0.9999


@needs_kernel
def test_gpt2_layers_with_their_biases_run_on_the_kernel(tmp_path, tiny_model_dir):
    from tests.test_model_gpt2 import tiny_gpt2

    _, model_dir = tiny_gpt2(tmp_path, tiny_model_dir)

    def runner(**kwargs) -> ModelRunner:
        return ModelRunner(model_dir, "auto", torch.device("cpu"), torch.bfloat16, 2, 64, **kwargs)

    with_kernel, without = runner(bf16_small_batch=True), runner()
    layer, plain = with_kernel.model.layers[0]["qkv"], without.model.layers[0]["qkv"]
    assert layer.bf16_blocks is not None and layer.bias is not None
    x = _bf16(2, with_kernel.model.shape.hidden_size, seed=12)
    got, expected = layer(x).float(), plain(x).float()
    assert ((got - expected).abs() <= expected.abs() / 64 + 2 ** -6).all()
    # --cpu-bf16-matmul kernels: larger steps on a kernel too, biases and the lm_head included.
    all_steps = runner(cpu_bf16_matmul="kernels").model
    assert all_steps.layers[0]["qkv"].bf16_large is not None and all_steps.lm_head.bf16_large is not None
    x = _bf16(12, with_kernel.model.shape.hidden_size, seed=13)
    got, expected = all_steps.layers[0]["qkv"](x).float(), plain(x).float()
    assert ((got - expected).abs() <= expected.abs() / 64 + 2 ** -6).all()


# ---- bf16_linear_fma: larger steps in float32 FMAs (--cpu-bf16-matmul kernels) ----------------


@needs_kernel
@pytest.mark.parametrize("n,k", [(576, 576), (576, 1536), (6, 40), (33, 100), (5, 8), (70, 96)],
                         ids=["square", "down", "padded-both", "odd", "under-one-column-block", "partial-tile"])
@pytest.mark.parametrize("m", ROWS)
def test_fma_matmul_matches_the_float64_matmul(n, k, m):
    weight, x, bias = _bf16(n, k, seed=n * 7 + k), _bf16(m, k, seed=m), _bf16(n, seed=n)
    packed = pack_row_blocks(weight)
    got = module.bf16_linear_fma(x, packed, n, k)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    if m == 0:
        return
    exact = x.double() @ weight.double().t()
    assert ((got.double() - exact).abs() <= _bound(x, weight, exact)).all()
    with_bias = module.bf16_linear_fma(x, packed, n, k, bias).double()
    exact_with_bias = exact + bias.double()
    assert ((with_bias - exact_with_bias).abs() <= _bound(x, weight, exact_with_bias)).all()
    # The same products, summed in the same order as VDPBF16PS's (odd column, then even, per lane):
    # the same bits, so --cpu-bf16-matmul kernels may hand a step to either.
    assert torch.equal(got, module.bf16_linear(x, packed, n, k))
    assert torch.equal(module.bf16_linear_fma(x, packed, n, k, bias), module.bf16_linear(x, packed, n, k, bias))


@needs_kernel
def test_fma_matmul_masks_columns_past_k_and_keeps_rows_apart():
    weight = _bf16(8, 40, seed=13)
    x = _bf16(6, 40, seed=14)
    x[1] = 0
    x[2, 5] = float("nan")
    x[3, :24] = float("inf")  # the row before it ends in 8 columns of its last 32-column chunk
    got = module.bf16_linear_fma(x, pack_row_blocks(weight), 8, 40)
    assert torch.equal(got[1], torch.zeros(8, dtype=torch.bfloat16))
    assert got[2].isnan().all() and not got[3].isfinite().any()
    for row in (0, 4, 5):
        exact = x[row:row + 1].double() @ weight.double().t()
        assert got[row].isfinite().all()
        assert ((got[row].double() - exact).abs() <= _bound(x[row:row + 1], weight, exact)).all()


@needs_kernel
def test_fma_matmul_refuses_what_it_was_not_built_for():
    weight = _bf16(8, 64, seed=5)
    packed = pack_row_blocks(weight)
    assert module.bf16_linear_fma(_bf16(40, 64, seed=7), packed, 8, 64).shape == (40, 8)  # no row limit
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        module.bf16_linear_fma(_bf16(1, 96, seed=8), packed, 8, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        module.bf16_linear_fma(_bf16(1, 64, seed=8), packed, 3, 64)
    with pytest.raises(RuntimeError, match="packed"):
        module.bf16_linear_fma(_bf16(1, 64, seed=8), weight, 8, 64)
    with pytest.raises(RuntimeError, match="bias"):
        module.bf16_linear_fma(_bf16(1, 64, seed=8), packed, 8, 64, torch.zeros(8))


@needs_kernel
@pytest.mark.parametrize("large_steps", sorted(LARGE_STEP_KERNELS))
def test_linear_on_all_steps_keeps_only_the_packed_copy(large_steps):
    weight, bias = _bf16(96, 64, seed=9), _bf16(96, seed=10)
    layer = Linear(weight, bias, bf16_kernel=module, bf16_large_steps=large_steps)
    assert layer.packed_weight is None and layer.weight is None and layer.bf16_blocks is not None
    larger = getattr(module, LARGE_STEP_KERNELS[large_steps])
    for rows in (1, BF16_KERNEL_MAX_TOKENS, BF16_KERNEL_MAX_TOKENS + 1, 64):
        x = _bf16(rows, 64, seed=rows)
        expected = (module.bf16_linear(x, layer.bf16_blocks, 96, 64, bias) if rows <= BF16_KERNEL_MAX_TOKENS
                    else larger(x, layer.bf16_blocks, 96, 64, bias))
        assert torch.equal(layer(x), expected)
    assert layer(torch.zeros(0, 64).bfloat16()).shape == (0, 96)
    with pytest.raises(ValueError, match="with the bf16 kernel module"):
        Linear(weight, bf16_large_steps=large_steps)
    with pytest.raises(ValueError, match="bf16_large_steps 'amx'"):
        Linear(weight, bf16_kernel=module, bf16_large_steps="amx")


@pytest.mark.parametrize("other", [{"batch_invariant": True}, {"dtype": "float32"}, {"device": "cuda"}],
                         ids=["batch-invariant", "float32", "cuda"])
def test_config_refuses_the_kernels_with_paths_they_do_not_serve(other):
    with pytest.raises(ValueError, match="--cpu-bf16-matmul kernels"):
        Config(cpu_bf16_matmul="kernels", **other)
    Config(cpu_bf16_matmul="auto", **other)  # auto falls back to oneDNN there instead
    Config(cpu_bf16_matmul="kernels", int8_small_batch=True)  # the kernels take the steps int8 does not
    with pytest.raises(ValueError, match="auto, onednn or kernels"):
        Config(cpu_bf16_matmul="fma")


@needs_kernel
def test_with_int8_small_steps_the_kernels_take_the_larger_ones():
    weight, bias = _bf16(96, 64, seed=31), _bf16(96, seed=32)
    layer = Linear(weight, bias, int8_small_batch=True, int8_kernel=kernels.int8_linear_module(),
                   bf16_kernel=module, bf16_large_steps="vdpbf16ps")
    int8_only = Linear(weight, bias, int8_small_batch=True, int8_kernel=kernels.int8_linear_module())
    assert layer.packed_weight is None and layer.weight is None and layer.bf16_max_tokens == 0
    for rows in (1, layer.int8_max_tokens, layer.int8_max_tokens + 1, 40):
        x = _bf16(rows, 64, seed=rows + 30)
        expected = (int8_only(x) if rows <= layer.int8_max_tokens
                    else module.bf16_linear(x, layer.bf16_blocks, 96, 64, bias))
        assert torch.equal(layer(x), expected)


@needs_kernel
def test_the_probe_times_onednn_and_each_kernel():
    times = kernel_matmul_times(module, rows=16, features=256, trials=2)
    assert set(times) == {"onednn", *LARGE_STEP_KERNELS}
    assert all(0 < seconds < float("inf") for seconds in times.values())


@needs_kernel
def test_model_runner_modes_pick_the_matmul(tiny_model_dir, monkeypatch):
    def runner(**kwargs) -> ModelRunner:
        return ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.bfloat16, 2, 64, kv_cache_tokens=128,
                           **kwargs)

    def probe(**seconds: float) -> None:
        monkeypatch.setattr("model_worker.model_runner.kernel_matmul_times", lambda kernel: seconds)

    # kernels takes the faster of the two for larger steps, whatever oneDNN's time.
    probe(onednn=1.0, vdpbf16ps=3.0, fma=2.0)
    onednn, kernels_ = runner(), runner(cpu_bf16_matmul="kernels")
    assert onednn.model.lm_head.bf16_large is None and onednn.model.lm_head.packed_weight is not None
    assert all(layer["qkv"].bf16_large is module.bf16_linear_fma and layer["qkv"].packed_weight is None
               for layer in kernels_.model.layers)
    # auto follows the probe: the kernels where the faster is within KERNEL_MATMUL_MIN_SPEEDUP of oneDNN.
    probe(onednn=1.0, vdpbf16ps=1.1, fma=3.0)
    assert runner(cpu_bf16_matmul="auto").model.lm_head.bf16_large is module.bf16_linear
    probe(onednn=1.0, vdpbf16ps=2.0, fma=3.0)
    slower = runner(cpu_bf16_matmul="auto").model.lm_head
    assert slower.bf16_large is None and slower.bf16_blocks is None and slower.packed_weight is not None
    with_int8 = runner(cpu_bf16_matmul="kernels", int8_small_batch=True).model.lm_head
    assert with_int8.int8_weight is not None and with_int8.bf16_large is module.bf16_linear
    assert with_int8.packed_weight is None
    # Kernels off (--no-cpu-decode-kernel): oneDNN whatever the mode.
    assert runner(cpu_bf16_matmul="kernels", cpu_decode_kernel=False).model.lm_head.bf16_large is None
    hidden = _bf16(12, onednn.shape.hidden_size, seed=11)  # > 8 rows: the FMA kernel's steps here
    a, b = kernels_.model.logits(hidden).float(), onednn.model.logits(hidden).float()
    assert not torch.equal(a, b)
    assert F.cosine_similarity(a, b).min().item() > 0.9999
