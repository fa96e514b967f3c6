"""model_worker/triton_ops.py against the torch ops it replaces on CUDA (llama.py's and attention.py's).

On a GPU (marked gpu) in bf16, where they must agree to bf16 rounding; elsewhere through Triton's
interpreter in float32, where its numpy arithmetic is exact but its bf16
casts truncate (the test extra installs triton for that; it skips where triton is missing)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

# Without a GPU the kernels run in Triton's interpreter, which reads TRITON_INTERPRET as triton is
# imported, as the kernels are defined and as they run: set for those and during this module's tests
# only, so the variable does not reach the processes other tests start.
INTERPRETED = not torch.cuda.is_available()


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    before = os.environ.get("TRITON_INTERPRET")
    if INTERPRETED:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(autouse=True)
def _interpreter_while_testing() -> Iterator[None]:
    with interpreting():
        yield


with interpreting():
    pytest.importorskip("triton")
    from model_worker import triton_ops

if INTERPRETED:
    from triton.runtime import interpreter

    # The interpreter turns a scalar into an int with int() of a one-element array, which NumPy 2.4
    # refuses: a loop bounded by a kernel argument or a loaded value would fail here, not on a GPU.
    _patch_lang_tensor = getattr(interpreter, "_patch_lang_tensor", None)

    def _patch_with_scalar_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if _patch_lang_tensor is not None:
        interpreter._patch_lang_tensor = _patch_with_scalar_index

from model_worker.attention_metadata import AttentionMetadata, DecodeBatch  # noqa: E402
from model_worker.kv_cache import PagedKVCache  # noqa: E402
from model_worker.models import llama  # noqa: E402
from model_worker.models.attention import paged_attention  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def assert_close_rounding(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 1.0,
                          floor: float = 1e-2) -> None:
    """Equal up to `ulps` units of the last place of bf16; in float32 (the interpreter: numpy's exp
    and summation order) to a few units."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a, e = actual.float(), expected.float()
    assert torch.isfinite(a).all()
    eps = torch.finfo(expected.dtype).eps
    if expected.dtype == torch.float32:
        ulps = 8
    tolerance = ulps * eps * e.abs().clamp(min=floor) + (1e-5 if expected.dtype == torch.float32 else 0)
    bad = (a - e).abs() > tolerance
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ; worst {float((a - e).abs().max())}"


@pytest.mark.parametrize("num_tokens,hidden", [(1, 4096), (5, 576), (3, 100)])
def test_norms_match_the_torch_ops(num_tokens, hidden):
    gen = torch.Generator().manual_seed(num_tokens)
    x, delta = (torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(DEVICE, DTYPE)
    assert_close_rounding(triton_ops.rms_norm(x, weight, 1e-5), llama.rms_norm(x, weight, 1e-5), ulps=2)
    total, normed = triton_ops.add_rms_norm(x, delta, weight, 1e-5)
    want_total, want_normed = llama.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, want_total)
    assert_close_rounding(normed, want_normed, ulps=2)


@pytest.mark.parametrize("num_tokens,inner", [(1, 14336), (4, 1536), (2, 1000)])
def test_silu_and_mul_matches_the_torch_ops(num_tokens, inner):
    gate_up = torch.randn(num_tokens, 2 * inner, generator=torch.Generator().manual_seed(inner)).to(DEVICE, DTYPE) * 4
    assert_close_rounding(triton_ops.silu_and_mul(gate_up), llama.silu_and_mul(gate_up), ulps=1)


def make_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, seed: int) -> PagedKVCache:
    kv = PagedKVCache(2, num_blocks, block_size, num_kv_heads, head_dim, DTYPE, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    kv.key.copy_(torch.randn(kv.key.shape, generator=gen))
    kv.value.copy_(torch.randn(kv.value.shape, generator=gen))
    return kv


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (4, 4, 16)])
def test_rope_and_cache_matches_the_torch_ops(num_heads, num_kv_heads, head_dim):
    num_tokens, block_size = 6, 4
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, DTYPE)
    positions = torch.tensor([0, 1, 7, 30, 31, 5], device=DEVICE)
    slots = torch.tensor([3, 17, 8, 9, 0, 22], device=DEVICE)  # any free slots, out of order
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(DEVICE, DTYPE)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(DEVICE, DTYPE)
    ours, theirs = (make_cache(8, block_size, num_kv_heads, head_dim, seed=1) for _ in range(2))
    qk = triton_ops.rope_and_cache(qkv, positions, cos, sin, ours.layer_keys[1], ours.layer_values[1], slots,
                                   num_heads, num_kv_heads)
    # llama.py's torch path
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    want = qkv[:, :q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim)
    c, s = cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]
    want = want * c + llama.rotate_half(want) * s
    theirs.write(1, slots, want[:, num_heads:], qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim))
    # Exact in float32 (the interpreter). In bf16 on an H100, 28 of 768 elements differed by one
    # unit of the last place of the larger product (x * cos or rotate_half(x) * sin, each rounded
    # as the torch ops round them), so the bound is one such unit: 2 ulps of max(|out|, 2).
    assert_close_rounding(qk, want, ulps=2, floor=2.0)
    assert_close_rounding(ours.key, theirs.key, ulps=2, floor=2.0)  # layer 0 untouched, the other slots too
    assert torch.equal(ours.value, theirs.value)


def torch_decode_attention(q, kv: PagedKVCache, block_tables, seq_lens, window: int, scale: float) -> torch.Tensor:
    """attention.py's gather + SDPA decode path, on the same inputs."""
    batch, width = block_tables.shape
    key_positions = torch.arange(width * kv.block_size, device=DEVICE)
    decode = DecodeBatch.masked(0, block_tables, seq_lens, key_positions, window)
    meta = AttentionMetadata(positions=seq_lens - 1, slot_mapping=seq_lens * 0, prefills=[], decode=decode,
                             sliding_window=window)
    return paged_attention(0, q, q[:, :kv.key.shape[3]], q[:, :kv.key.shape[3]], meta, kv, scale,
                           sliding=window > 0).view(q.shape)


@pytest.mark.parametrize("batch,num_heads,num_kv_heads,head_dim,width,window", [
    (1, 32, 8, 128, 40, 0),  # Llama-3-8B, one stream: split over the context
    (3, 9, 3, 64, 6, 0),  # SmolLM2's heads, a short bucket: one split
    (64, 32, 8, 128, 8, 0),  # a full batch
    (2, 4, 2, 16, 30, 37),  # a sliding window that starts mid-tile
    (5, 8, 8, 32, 3, 0),  # no GQA
])
def test_paged_decode_attention_matches_gather_and_sdpa(batch, num_heads, num_kv_heads, head_dim, width, window):
    block_size, num_blocks = 16, 48
    kv = make_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=batch)
    gen = torch.Generator().manual_seed(width)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(DEVICE, DTYPE)
    seq_lens = torch.randint(1, width * block_size + 1, (batch,), generator=gen)
    seq_lens[0] = width * block_size  # one that fills its table
    tables = torch.randint(0, num_blocks, (batch, width), generator=gen)
    scale = head_dim ** -0.5
    got = triton_ops.paged_decode_attention(q, kv.layer_keys[0], kv.layer_values[0], tables.to(DEVICE),
                                            seq_lens.to(DEVICE), window, scale)
    want = torch_decode_attention(q, kv, tables.to(DEVICE), seq_lens.to(DEVICE), window, scale)
    # bf16 on the GPU: probabilities rounded to bf16 before the value product, as flash attention does.
    tolerance = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
    assert torch.isfinite(got.float()).all()
    assert float((got.float() - want.float()).abs().max()) <= tolerance * float(want.float().abs().max())


def test_split_count_depends_on_shapes_only():
    assert triton_ops.num_splits_for(1, 8, 1024, 64) == 8  # 1024 positions: at most 8 splits of 128
    assert triton_ops.num_splits_for(1, 8, 64, 64) == 1
    assert triton_ops.num_splits_for(64, 8, 8192, 64) == 1  # 512 programs already fill the GPU
    assert triton_ops.num_splits_for(4, 8, 8192, 64) == 9


@pytest.mark.parametrize("rows,n,k", [(1, 70, 300), (3, 4096, 512), (16, 33, 64)])
def test_small_batch_linear_matches_a_matmul(rows, n, k):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, DTYPE)
    weight = torch.randn(n, k, generator=gen).to(DEVICE, DTYPE)
    got = triton_ops.small_batch_linear(x, weight, block_n=32, block_k=128)
    want = (x.double() @ weight.double().T)
    # bf16 output: half an ulp of rounding; float32 (the interpreter): summation order.
    tolerance = 2 ** -8 if DTYPE == torch.bfloat16 else 1e-4
    assert got.shape == (rows, n)
    assert float(((got.double() - want).abs() / want.abs().clamp(min=1.0)).max()) <= tolerance


@pytest.mark.gpu
def test_float32_attention_is_not_rounded_to_tf32():
    """A --dtype float32 model's decode attention in float32 on a GPU: tl.dot would round its inputs
    to tf32 (~1e-3 relative) by default; dot_precision asks for full precision."""
    kv = PagedKVCache(1, 40, 16, 8, 128, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(3)
    kv.key.copy_(torch.randn(kv.key.shape, generator=gen))
    kv.value.copy_(torch.randn(kv.value.shape, generator=gen))
    q = torch.randn(2, 32, 128, generator=gen).to(DEVICE)
    tables = torch.randint(0, 40, (2, 36), generator=gen).to(DEVICE)
    seq_lens = torch.tensor([576, 300], device=DEVICE)
    got = triton_ops.paged_decode_attention(q, kv.layer_keys[0], kv.layer_values[0], tables, seq_lens, 0, 128 ** -0.5)
    want = torch_decode_attention(q.double(), _as_double(kv), tables, seq_lens, 0, 128 ** -0.5)
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5


def _as_double(kv: PagedKVCache) -> PagedKVCache:
    double = PagedKVCache(1, kv.num_blocks, kv.block_size, kv.key.shape[3], kv.key.shape[4], torch.float64, DEVICE)
    double.key.copy_(kv.key)
    double.value.copy_(kv.value)
    return double


def test_startup_probe_runs_the_kernels_and_falls_back_when_one_cannot(monkeypatch):
    """kernels_run_here, as ModelRunner calls it on CUDA: both kernels run on tiny inputs; the matmul
    only on Hopper; a kernel that fails to launch (as Triton's OutOfResources would) is left out."""
    if not ON_GPU:  # the interpreter runs the kernels; fake what it has no CUDA for
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = torch.cuda.get_device_capability(DEVICE)[0] == 9
    assert triton_ops.small_ops_run_here(DEVICE, DTYPE)
    assert triton_ops.kernels_run_here(DEVICE, torch.bfloat16, 32, 8, 128) == (True, hopper)
    assert triton_ops.kernels_run_here(DEVICE, torch.float32, 32, 8, 128) == (True, False)  # bf16 only
    assert triton_ops.kernels_run_here(DEVICE, torch.bfloat16, 4, 2, 96) == (False, hopper)  # not a power of two

    def out_of_resources(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(triton_ops, "paged_decode_attention", out_of_resources)
    monkeypatch.setattr(triton_ops, "small_batch_linear", out_of_resources)
    monkeypatch.setattr(triton_ops, "rope_and_cache", out_of_resources)
    assert triton_ops.kernels_run_here(DEVICE, torch.bfloat16, 32, 8, 128) == (False, False)
    assert not triton_ops.small_ops_run_here(DEVICE, DTYPE)
