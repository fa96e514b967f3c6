"""The GGUF-format weights for small CPU steps (--int4-small-batch): GGUF's Q4_1 (the decoder
layers) and Q8_0 (a Q8_0 file's lm_head) found again in dequantized weights
(model_worker/models/linear.py), and the compiled matmuls on them (model_worker/kernels/gguf_linear.cpp).

The kernel tests skip where it cannot be used (a CPU without AVX512-BW/VNNI, no C++ compiler);
the model then keeps bf16 for every step. Where both are there, a kernel that fails to build
fails these tests instead of skipping them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_worker import kernels
from model_worker.config import Config
from model_worker.model_runner import ModelRunner
from model_worker.models.linear import (
    GGUF_FORMAT_MAX_TOKENS,
    GGUF_KERNEL_MAX_TOKENS,
    Linear,
    dequantize_q4_1,
    dequantize_q8_0,
    pack_q4_1_blocks,
    pack_q8_0_blocks,
    quantize_q4_1,
    quantize_q8_0,
)

CAN_BUILD = kernels.can_build(set(kernels.GGUF_LINEAR_FLAGS))
module = kernels.gguf_linear_module()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no AVX512-VNNI CPU or no C++ compiler here")


def test_the_kernel_builds_where_it_can():
    assert (module is not None) == CAN_BUILD


def _q4_1(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q4_1 weights as a GGUF holds them: q in 0..15 with each group's 0 and 15 used (its
    minimum and maximum), float16 d > 0 and m."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8).view(n, k // 32, 32)
    q[..., 3], q[..., 17] = 0, 15
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).to(torch.float16)
    m = (torch.randn(n, k // 32, generator=gen) * 0.1).to(torch.float16)
    return q.reshape(n, k), d, m


def test_quantizing_dequantized_q4_1_gives_back_its_q_d_and_m():
    q, d, m = _q4_1(40, 96, seed=1)
    got_q, got_d, got_m = quantize_q4_1(dequantize_q4_1(q, d, m))
    assert torch.equal(got_q, q) and torch.equal(got_d, d) and torch.equal(got_m, m)
    # Any weight comes within half a step of its group; an all-equal group is m exactly (d = 0).
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    w[3, :32] = 0.25
    q, d, m = quantize_q4_1(w)
    assert ((dequantize_q4_1(q, d, m) - w).abs() <= d.float().repeat_interleave(32, 1) * 0.5 + 1e-3).all()
    assert d[3, 0] == 0 and torch.equal(dequantize_q4_1(q, d, m)[3, :32], w[3, :32])
    with pytest.raises(ValueError, match="float16"):
        quantize_q4_1(torch.full((4, 32), 1e6))


def test_the_default_gguf_q4_1_blocks_come_back_from_the_converted_weights(smollm2_dir):
    """The claim --int4-small-batch auto rests on: SmolLM2's file's own Q4_1 blocks (d, m, q of
    ffn_down, whose rows llama.cpp does not permute) from the float32 weights transformers wrote."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    source = json.loads((smollm2_dir / "tokenwire_source.json").read_text())["gguf"]
    tensor = next(t for t in GGUFReader(source).tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    weight = load_file(str(smollm2_dir / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    n, k = weight.shape
    blocks = np.asarray(tensor.data).reshape(n, k // 32, 20)  # Q4_1 block: d, m (float16), 16 nibble bytes
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    nibbles = torch.from_numpy(blocks[..., 4:].copy())
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).reshape(n, k)  # byte j: column j low, j + 16 high
    got_q, got_d, got_m = quantize_q4_1(weight)
    # A group whose values are all equal has d = 0 here; the file may hold any d for it.
    varied = d.float() * 15 > 0
    assert torch.equal(got_m, m)
    assert torch.equal(got_d[varied], d[varied])
    assert torch.equal(got_q.view(n, k // 32, 32)[varied], q.view(n, k // 32, 32)[varied])


def test_packing_puts_each_block_of_four_rows_and_its_scales_in_one_stream():
    q, d, m = _q4_1(6, 64, seed=3)
    packed = pack_q4_1_blocks(q, d, m)
    assert packed.shape == (2, 2, 80) and packed.dtype == torch.uint8  # rows 6 -> 8, zero-padded
    row, group = 5, 1  # block 1, row 1 of it
    nibbles = packed[1, group, 16:32]
    assert torch.equal(nibbles & 15, q[row, 32:48]) and torch.equal(nibbles >> 4, q[row, 48:64])
    assert packed[1, group, 64:72].view(torch.float16)[1] == d[row, group]
    assert packed[1, group, 72:80].view(torch.float16)[1] == m[row, group]
    assert not packed[1, :, 32:64].any() and not packed[1, :, 68:72].any()  # padding rows 6, 7


def _exact(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x.double() @ dequantize_q4_1(q, d, m).double().t()


def _bound(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """bf16 output rounding, float32 sums, plus x's int8 rounding: half a step of the group's
    max|x| / 127 per element, times the weight."""
    n, k = q.shape
    steps = x.double().abs().view(x.shape[0], k // 32, 32).amax(2) / 127  # [M, G]
    weights = dequantize_q4_1(q, d, m).double().abs().view(n, k // 32, 32).sum(2)  # [N, G]
    return exact.abs() / 200 + 0.5 * steps @ weights.t() + 1e-6


@needs_kernel
@pytest.mark.parametrize("n,k", [(576, 576), (960, 576), (576, 1536), (6, 64), (33, 96)],
                         ids=["square", "qkv", "down", "padded-rows", "odd-rows"])
@pytest.mark.parametrize("rows", list(range(0, GGUF_KERNEL_MAX_TOKENS + 1)))
def test_matches_the_dequantized_matmul(n, k, rows):
    q, d, m = _q4_1(n, k, seed=n * 7 + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = module.q4_1_linear(x, pack_q4_1_blocks(q, d, m), n)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    if rows == 0:
        return
    exact = _exact(x, q, d, m)
    assert ((got.double() - exact).abs() <= _bound(x, q, d, m, exact)).all()
    with_bias = module.q4_1_linear(x, pack_q4_1_blocks(q, d, m), n, bias).double()
    assert ((with_bias - exact - bias.double()).abs() <= _bound(x, q, d, m, exact) + bias.double().abs() / 128).all()


@needs_kernel
def test_zero_rows_stay_zero_and_a_non_finite_row_only_spoils_itself():
    q, d, m = _q4_1(64, 96, seed=4)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[1] = 0
    x[2, 5] = float("nan")
    x[3, 70] = float("inf")
    x[0, 40:60] = 1e-38  # a group of values whose int8 scale is subnormal: no inf, no NaN
    got = module.q4_1_linear(x, pack_q4_1_blocks(q, d, m), 64)
    assert torch.equal(got[1], torch.zeros(64, dtype=torch.bfloat16))
    assert got[2].isnan().all() and got[3].isnan().all()
    exact = _exact(x[:1], q, d, m)
    assert got[0].isfinite().all()
    assert ((got[0].double() - exact).abs() <= _bound(x[:1], q, d, m, exact)).all()


@needs_kernel
def test_refuses_what_it_was_not_built_for():
    q, d, m = _q4_1(8, 64, seed=5)
    packed = pack_q4_1_blocks(q, d, m)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        module.q4_1_linear(torch.randn(9, 64).bfloat16(), packed, 8)
    with pytest.raises(RuntimeError, match="columns"):
        module.q4_1_linear(torch.randn(1, 96).bfloat16(), packed, 8)
    with pytest.raises(RuntimeError, match="rows"):
        module.q4_1_linear(x, packed, 12)
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.q4_1_linear(x.float(), packed, 8)
    with pytest.raises(RuntimeError, match="packed"):
        module.q4_1_linear(x, q, 8)  # the plain [N, K] values


@needs_kernel
def test_linear_uses_q4_1_up_to_its_row_limit_and_bf16_beyond():
    gen = torch.Generator().manual_seed(6)
    source = torch.randn(96, 64, generator=gen) * 0.05
    weight, bias = source.bfloat16(), torch.randn(96, generator=gen).bfloat16()
    layer = Linear(weight, bias, gguf_kernel=module, gguf_source=source)
    assert layer.gguf_blocks.shape == (24, 2, 80)
    q, d, m = quantize_q4_1(source)
    assert layer.gguf_max_tokens == GGUF_FORMAT_MAX_TOKENS["q4_1"] <= GGUF_KERNEL_MAX_TOKENS
    for rows in range(1, GGUF_KERNEL_MAX_TOKENS + 2):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        got = layer(x)
        if rows <= layer.gguf_max_tokens:
            assert torch.equal(got, module.q4_1_linear(x, pack_q4_1_blocks(q, d, m), 96, bias))
        else:
            assert torch.equal(got, F.linear(x, weight, bias))
    # Columns that do not split into groups of 32 keep bf16 for every step.
    odd = Linear(torch.randn(8, 40).bfloat16(), gguf_kernel=module)
    assert odd.gguf_blocks is None and odd.gguf_max_tokens == 0
    with pytest.raises(ValueError, match="not both"):
        Linear(weight, int8_small_batch=True, gguf_kernel=module)
    with pytest.raises(ValueError, match="batch-invariant"):
        Linear(weight, row_tile=16, gguf_kernel=module)


@needs_kernel
def test_model_runner_puts_the_decoder_matmuls_on_q4_1_and_keeps_the_lm_head(tiny_model_dir):
    def runner(**kwargs) -> ModelRunner:
        return ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.bfloat16, 2, 64, kv_cache_tokens=128,
                           **kwargs)

    int4, bf16 = runner(int4_small_batch=True), runner()
    for layer in int4.model.layers:
        assert all(layer[name].gguf_blocks is not None for name in ("qkv", "o", "gate_up", "down"))
    assert int4.model.lm_head.gguf_blocks is None
    # One decoder matmul on int4 against bf16: the same weights to 4 bits.
    hidden = torch.randn(3, int4.shape.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    a, b = int4.model.layers[0]["gate_up"](hidden).float(), bf16.model.layers[0]["gate_up"](hidden).float()
    assert F.cosine_similarity(a, b).min().item() > 0.99


def test_auto_is_on_only_for_a_q4_1_gguf_on_a_bf16_cpu(smollm2_dir, tiny_model_dir):
    from model_worker.__main__ import gguf_small_steps
    from model_worker.model_files import gguf_weight_types

    def resolved(model_dir, *flags, dtype=torch.bfloat16) -> tuple[bool, bool]:
        config = Config(model=str(model_dir))
        for flag, value in zip(flags[::2], flags[1::2], strict=True):
            setattr(config, flag, value)
        hf_config = json.loads((model_dir / "config.json").read_text())
        return gguf_small_steps(config, model_dir, hf_config, torch.device("cpu"), dtype)

    assert gguf_weight_types(smollm2_dir) == ({"Q4_1"}, "Q8_0")
    assert gguf_weight_types(tiny_model_dir) == (set(), "")
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= kernels.cpu_flags()
    assert resolved(smollm2_dir) == (vnni, vnni)
    assert resolved(tiny_model_dir) == (False, False)  # not from a GGUF: no 4-bit weights to keep
    assert resolved(smollm2_dir, dtype=torch.float32) == (False, False)
    assert resolved(smollm2_dir, "int8_small_batch", True) == (False, False)
    assert resolved(smollm2_dir, "batch_invariant", True) == (False, False)
    assert resolved(smollm2_dir, "int4_small_batch", "off") == (False, False)
    assert resolved(tiny_model_dir, "int4_small_batch", "on") == (True, False)  # its lm_head stays bf16
    with pytest.raises(ValueError, match="int4-small-batch"):
        Config(int4_small_batch="on", int8_small_batch=True)
    with pytest.raises(ValueError, match="auto, on or off"):
        Config(int4_small_batch="yes")


# ---- Q8_0 (the lm_head of a Q8_0 file) ----

def _q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 weights as a GGUF holds them: q in -127..127 with each group's largest |q| 127."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int32).to(torch.int8).view(n, k // 32, 32)
    q[..., 5] = 127
    q[..., 6] = -127
    d = (torch.rand(n, k // 32, generator=gen) * 0.002 + 1e-5).to(torch.float16)
    return q.reshape(n, k), d


def test_quantizing_dequantized_q8_0_gives_back_its_q_and_d():
    q, d = _q8_0(40, 96, seed=11)
    got_q, got_d = quantize_q8_0(dequantize_q8_0(q, d))
    assert torch.equal(got_q, q) and torch.equal(got_d, d)
    zeros_q, zeros_d = quantize_q8_0(torch.zeros(4, 32))
    assert not zeros_q.any() and not zeros_d.any()


def test_the_default_gguf_q8_0_lm_head_comes_back_from_the_converted_embedding(smollm2_dir):
    from gguf import GGUFReader
    from safetensors.torch import load_file

    source = json.loads((smollm2_dir / "tokenwire_source.json").read_text())["gguf"]
    tensor = next(t for t in GGUFReader(source).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type.name == "Q8_0"
    weight = load_file(str(smollm2_dir / "model.safetensors"))["model.embed_tokens.weight"]
    n, k = weight.shape
    blocks = np.asarray(tensor.data).reshape(n, k // 32, 34)  # Q8_0 block: d (float16), 32 int8
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)
    got_q, got_d = quantize_q8_0(weight)
    assert torch.equal(got_d, d) and torch.equal(got_q, q)


def test_q8_0_packing_holds_rows_scales_and_sums():
    q, d = _q8_0(6, 64, seed=12)
    packed = pack_q8_0_blocks(q, d)
    assert packed.shape == (2, 2, 144)
    row, group = 5, 1
    assert torch.equal(packed[1, group, 32:64].view(torch.int8), q[row, 32:64])
    assert packed[1, group, 128:136].view(torch.float16)[1] == d[row, group]
    assert packed[1, group, 136:144].view(torch.int16)[1] == q[row, 32:64].int().sum()
    assert not packed[1, :, 64:128].any()  # padding rows 6, 7


@needs_kernel
@pytest.mark.parametrize("n,k", [(49152, 576), (960, 576), (6, 64), (33, 96)],
                         ids=["lm-head", "qkv", "padded-rows", "odd-rows"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_q8_0_matches_the_dequantized_matmul(n, k, rows):
    q, d = _q8_0(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = module.q8_0_linear(x, pack_q8_0_blocks(q, d), n).double()
    weight = dequantize_q8_0(q, d).double()
    exact = x.double() @ weight.t()
    steps = x.double().abs().view(rows, k // 32, 32).amax(2) / 127
    bound = exact.abs() / 200 + 0.5 * steps @ weight.abs().view(n, k // 32, 32).sum(2).t() + 1e-6
    assert ((got - exact).abs() <= bound).all()


@needs_kernel
def test_q8_0_zero_rows_stay_zero_and_a_non_finite_row_only_spoils_itself():
    q, d = _q8_0(64, 96, seed=13)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(14)).bfloat16()
    x[1] = 0
    x[2, 50] = float("nan")
    got = module.q8_0_linear(x, pack_q8_0_blocks(q, d), 64)
    assert torch.equal(got[1], torch.zeros(64, dtype=torch.bfloat16))
    assert got[2].isnan().all() and got[0].isfinite().all()
    with pytest.raises(RuntimeError, match="144"):
        module.q8_0_linear(x, pack_q4_1_blocks(*_q4_1(64, 96, seed=1)), 64)  # Q4_1's 80-byte groups


@needs_kernel
def test_model_runner_keeps_a_q8_0_lm_head_only_when_asked(tiny_model_dir):
    def runner(**kwargs) -> ModelRunner:
        return ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.bfloat16, 2, 64, kv_cache_tokens=128,
                           **kwargs)

    q8_head, plain = runner(int4_small_batch=True, q8_0_lm_head=True), runner()
    head = q8_head.model.lm_head
    assert head.gguf_blocks is not None and head.gguf_blocks.shape[2] == 144
    hidden = torch.randn(3, q8_head.shape.hidden_size, generator=torch.Generator().manual_seed(15)).bfloat16()
    a, b = q8_head.model.logits(hidden).float(), plain.model.logits(hidden).float()
    assert F.cosine_similarity(a, b).min().item() > 0.999
    # Steps over the kernel's rows take the bf16 head, which is the plain runner's.
    assert head.gguf_max_tokens == GGUF_FORMAT_MAX_TOKENS["q8_0"]
    big = torch.randn(head.gguf_max_tokens + 1, q8_head.shape.hidden_size).bfloat16()
    assert torch.equal(q8_head.model.logits(big), plain.model.logits(big))


def test_layer_types_count_the_matmul_weights_only():
    from model_worker.model_files import split_gguf_weight_types

    # A Qwen2 file: q, k and v have biases, which llama.cpp keeps in F32 whatever the quantization.
    types = {"token_embd.weight": "Q8_0", "output_norm.weight": "F32"}
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        types[f"blk.0.{name}.weight"] = "Q4_1"
    types |= {"blk.0.attn_q.bias": "F32", "blk.0.attn_k.bias": "F32", "blk.0.attn_v.bias": "F32",
              "blk.0.attn_norm.weight": "F32"}
    assert split_gguf_weight_types(types) == ({"Q4_1"}, "Q8_0")
    assert split_gguf_weight_types(types | {"output.weight": "Q6_K"}) == ({"Q4_1"}, "Q6_K")


def test_off_reads_no_file_and_an_unreadable_source_only_turns_auto_off(tiny_model_dir, tmp_path, caplog):
    from model_worker.__main__ import gguf_small_steps

    model_dir = tmp_path / "converted"
    model_dir.mkdir()
    (model_dir / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    (tmp_path / "gone.gguf").write_bytes(b"not a gguf")
    (model_dir / "tokenwire_source.json").write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf")}))
    hf_config = json.loads((model_dir / "config.json").read_text())
    cpu = torch.device("cpu")
    assert gguf_small_steps(Config(int4_small_batch="off"), model_dir, hf_config, cpu, torch.bfloat16) == (False, False)
    assert not caplog.records  # the file was not opened
    assert gguf_small_steps(Config(), model_dir, hf_config, cpu, torch.bfloat16) == (False, False)
    if {"avx512f", "avx512bw", "avx512_vnni"} <= kernels.cpu_flags():
        assert "could not read" in caplog.text


@needs_kernel
def test_a_copy_that_rounds_its_source_again_is_known_and_said(tiny_model_dir, smollm2_dir, caplog):
    from model_worker.__main__ import warn_if_gguf_blocks_rounded

    q, d, m = _q4_1(8, 64, seed=16)
    exact = Linear(dequantize_q4_1(q, d, m).bfloat16(), gguf_kernel=module, gguf_source=dequantize_q4_1(q, d, m))
    assert exact.gguf_exact
    # An importance-matrix Q4_1 group: q within 1..14, so its minimum is not m nor its maximum m + 15 d.
    q[:, :32] = q[:, :32].clamp(1, 14)
    imatrix = Linear(dequantize_q4_1(q, d, m).bfloat16(), gguf_kernel=module, gguf_source=dequantize_q4_1(q, d, m))
    assert not imatrix.gguf_exact
    runner = ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.bfloat16, 2, 64, kv_cache_tokens=128,
                         int4_small_batch=True)  # random weights: no layer is exactly Q4_1
    warn_if_gguf_blocks_rounded(runner, tiny_model_dir)  # not from a GGUF: rounded by design, nothing said
    assert "not the file's exact blocks" not in caplog.text
    warn_if_gguf_blocks_rounded(runner, smollm2_dir)  # as if these weights had come from a Q4_1 file
    assert "8 of 8 GGUF-format copies are not the file's exact blocks" in caplog.text


@needs_kernel
def test_steps_past_the_gguf_limit_stream_the_bf16_copy():
    bf16 = kernels.bf16_linear_module()
    if bf16 is None:
        pytest.skip("no AVX512-BF16 kernel here")
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(17)).bfloat16()
    layer = Linear(weight, bf16_kernel=bf16, bf16_large_steps="fma", gguf_kernel=module)
    assert layer.gguf_max_tokens == GGUF_FORMAT_MAX_TOKENS["q4_1"] < layer.bf16_max_tokens
    x = torch.randn(layer.gguf_max_tokens + 1, 64).bfloat16()
    assert torch.equal(layer(x), bf16.bf16_linear(x, layer.bf16_blocks, 64, 64, None))
