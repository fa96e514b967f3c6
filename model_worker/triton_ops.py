"""Triton kernels for a Llama layer's small ops on CUDA, the GPU counterpart of kernels/llama_ops.cpp.

On an H100 a one-token decode step of a Llama-3-8B shape ran ~2400 kernels on torch ops, ~70 per
layer besides its four matmuls (norms as cast + norm + cast + scale, rotary as mul/neg/cat/mul/add,
two cache index_copy, two block gathers, SDPA with its mask); each takes 1-3 us even inside a CUDA
graph, 2 ms of a 7.5 ms step whose weights take 5. Here each is one kernel per layer:

- rms_norm / add_rms_norm: the residual add and the norm after it;
- rope_and_cache: rotary on q and k, and the k and v writes into the paged cache;
- silu_and_mul: the MLP's activation;
- paged_decode_attention: one query per sequence over its cached keys through the block table
  (no gather), GQA heads sharing each key load, split over the context when the batch is too small
  to fill the GPU (flash-decoding), with a second small kernel joining the splits.

Each rounds where the torch ops it replaces do (bf16 results of float32 arithmetic), so they agree
with the torch path to bf16 rounding; attention accumulates in float32. The functions take the
same arguments as llama_ops' (ModelRunner passes either module to LlamaModel). Nothing here runs on
a CPU path: tests run them through Triton's interpreter where triton is installed, and on a GPU.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

# A split of the context per program: long enough that its loads outweigh the join's.
MIN_SPLIT_POSITIONS = 128
# Programs that keep every SM of a current GPU busy (132 on an H100), twice over.
TARGET_PROGRAMS = 264
MAX_SPLITS = 64


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, stride_x, stride_delta, stride_sum,
                     stride_out, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)  # the residual, rounded as torch's add
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=inside)
    xf = x.to(tl.float32)
    normed = (xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype),
             mask=inside)


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> weight * rms_norm(x) [T, N], normalised in float32 (llama.rms_norm's rounding)."""
    out = torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](x, x, weight, x, out, x.stride(0), 0, 0, out.stride(0), x.shape[1], eps,
                                        HAS_DELTA=False, BLOCK=block, num_warps=_norm_warps(block))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)), x and delta [T, N]."""
    total, out = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](x, delta, weight, total, out, x.stride(0), delta.stride(0), total.stride(0),
                                        out.stride(0), x.shape[1], eps, HAS_DELTA=True, BLOCK=block,
                                        num_warps=_norm_warps(block))
    return total, out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=inside, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=inside, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu's bf16 result, then the bf16 product
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
             mask=inside)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    num_tokens, width = gate_up.shape
    n = width // 2
    out = gate_up.new_empty(num_tokens, n)
    if num_tokens:
        block = 1024
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                                  BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_and_cache_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, qk_ptr,
                           stride_qkv, stride_qk_t, stride_cos, stride_cache_block, stride_cache_pos,
                           stride_cache_head, block_size, num_heads, num_kv_heads,
                           HEAD_DIM: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads
    half = HEAD_DIM // 2
    first = tl.arange(0, HEAD_DIM // 2)
    position = tl.load(positions_ptr + token)
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(src + first)
    x2 = tl.load(src + half + first)
    cos1 = tl.load(cos_ptr + position * stride_cos + first).to(tl.float32)
    cos2 = tl.load(cos_ptr + position * stride_cos + half + first).to(tl.float32)
    sin1 = tl.load(sin_ptr + position * stride_cos + first).to(tl.float32)
    sin2 = tl.load(sin_ptr + position * stride_cos + half + first).to(tl.float32)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as the torch ops round them.
    out1 = ((a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    dst = qk_ptr + token * stride_qk_t + head * HEAD_DIM
    tl.store(dst + first, out1)
    tl.store(dst + half + first, out2)
    if head >= num_heads:
        kv_head = head - num_heads
        slot = tl.load(slots_ptr + token)
        at = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_pos + kv_head * stride_cache_head
        tl.store(k_cache_ptr + at + first, out1)
        tl.store(k_cache_ptr + at + half + first, out2)
        v_src = qkv_ptr + token * stride_qkv + (num_heads + num_kv_heads + kv_head) * HEAD_DIM
        tl.store(v_cache_ptr + at + first, tl.load(v_src + first))
        tl.store(v_cache_ptr + at + half + first, tl.load(v_src + half + first))


def rope_fits(head_dim: int) -> bool:
    """Head sizes rope_and_cache takes: an even power of two (the halves are Triton ranges)."""
    return head_dim >= 4 and head_dim & (head_dim - 1) == 0


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                   num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) D] -> rotary q and k [T, H + Hkv, D]; the rotary k and the v of each
    token written to its slot of k_cache / v_cache [num_blocks, block_size, Hkv, D]."""
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    qk = qkv.new_empty(num_tokens, num_heads + num_kv_heads, head_dim)
    if num_tokens:
        _rope_and_cache_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, qk, qkv.stride(0), qk.stride(0), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], num_heads, num_kv_heads,
            HEAD_DIM=head_dim, num_warps=1)
    return qk


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr,
                         part_ml_ptr, stride_q_t, stride_q_h, stride_cache_block, stride_cache_pos,
                         stride_cache_head, stride_tables, stride_out_t, stride_out_h, block_size, window, scale,
                         split_len, num_splits, GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
                         PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    lowest = 0
    if window > 0:
        lowest = tl.maximum(seq_len - window, 0)
    begin = split * split_len
    end = tl.minimum(seq_len, begin + split_len)
    # Whole tiles below the window hold nothing this query sees.
    begin = tl.maximum(begin, (lowest // BLOCK_N) * BLOCK_N)
    rows = tl.arange(0, BLOCK_GROUP)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
                mask=(rows < GROUP)[:, None], other=0.0)  # [BLOCK_GROUP, D]
    # A finite start, so a split with nothing to see keeps exp(m - max) = 0 weight and no NaN.
    m_i = tl.full((BLOCK_GROUP,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_GROUP,), tl.float32)
    acc = tl.zeros((BLOCK_GROUP, HEAD_DIM), tl.float32)
    for start in range(begin, end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        seen = (positions < end) & (positions >= lowest)
        block = tl.load(tables_ptr + seq * stride_tables + positions // block_size, mask=positions < end,
                        other=0)
        at = block * stride_cache_block + (positions % block_size) * stride_cache_pos + kv_head * stride_cache_head
        k = tl.load(k_cache_ptr + at[:, None] + dims[None, :], mask=seen[:, None], other=0.0)  # [BLOCK_N, D]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_GROUP, BLOCK_N], float32
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + at[:, None] + dims[None, :], mask=seen[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SINGLE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_out_t + heads[:, None] * stride_out_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(rows < GROUP)[:, None])
    else:
        # Partials [B, H, splits, D] and [B, H, splits, 2] (max, sum), float32.
        part = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_GROUP]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=(rows < GROUP)[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=rows < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=rows < GROUP)


@triton.jit
def _join_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_out_t, stride_out_h, num_heads, num_splits,
                        HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    inside = splits < num_splits
    row = (seq * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + row * 2, mask=inside, other=-1.0e30)
    s = tl.load(part_ml_ptr + row * 2 + 1, mask=inside, other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=inside[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(s * weight, axis=0)
    tl.store(out_ptr + seq * stride_out_t + head * stride_out_h + dims, out.to(out_ptr.dtype.element_ty))


def decode_tile_positions(dtype: torch.dtype, head_dim: int) -> int:
    """Key positions per tile of the decode attention: 64 for 16-bit heads of at most 128 (the tile
    measured on an H100), else 32, whose keys and values fit the shared memory of GPUs with less of
    it (head size 256 needs 80 KiB at 64 positions, over a T4's 64; float32 at 64 is over an A10's 100)."""
    return 64 if dtype in (torch.bfloat16, torch.float16) and head_dim <= 128 else 32


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 inputs in full precision ("ieee"; Triton's default rounds them
    to tf32, ~1e-3, where a --dtype float32 model expects float32 attention); 16-bit ones as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention_fits(head_dim: int, group: int) -> bool:
    """Shapes paged_decode_attention takes: a power-of-two head size of at least 16 (tl.dot)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and group >= 1


def num_splits_for(batch: int, num_kv_heads: int, max_positions: int, block_n: int) -> int:
    """Context splits per (sequence, kv head): enough programs to fill the GPU, none shorter than
    MIN_SPLIT_POSITIONS. Depends only on shapes, so a CUDA graph's bucket keeps one value."""
    most = max(1, min(MAX_SPLITS, max_positions // MIN_SPLIT_POSITIONS))
    wanted = triton.cdiv(TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    return max(1, min(most, wanted))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence), k_cache / v_cache [num_blocks, block_size, Hkv, D],
    block_tables [B, W] (positions past seq_lens unread), seq_lens [B] (the new token included),
    window: keys within the last `window` positions only (0: all) -> [B, H, D] in q's dtype.
    The same arguments as the C++ kernel's (kv.decode_kernel)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = q.new_empty(batch, num_heads, head_dim)
    if batch == 0:
        return out
    block_n = decode_tile_positions(q.dtype, head_dim)
    max_positions = block_tables.shape[1] * block_size
    num_splits = num_splits_for(batch, num_kv_heads, max_positions, block_n)
    split_len = triton.cdiv(triton.cdiv(max_positions, num_splits), block_n) * block_n
    single = num_splits == 1
    if single:
        part_acc = part_ml = out  # unused
    else:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        block_size, window, scale, split_len, num_splits, GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, SINGLE_SPLIT=single, PRECISION=dot_precision(q.dtype), num_warps=4)
    if not single:
        _join_splits_kernel[(batch, num_heads)](part_acc, part_ml, out, out.stride(0), out.stride(1), num_heads,
                                                num_splits, HEAD_DIM=head_dim,
                                                BLOCK_SPLITS=triton.next_power_of_2(num_splits), num_warps=1)
    return out


@triton.jit
def _small_batch_linear_kernel(x_ptr, w_ptr, out_ptr, num_rows, n, k, stride_x, stride_w, stride_out,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               PRECISION: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows < num_rows)[:, None] & (ks < k)[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=(cols < n)[:, None] & (ks < k)[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < num_rows)[:, None] & (cols < n)[None, :])


# Rows small_batch_linear takes (x is padded to them for the tensor cores).
SMALL_BATCH_MAX_ROWS = 16


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int = 16, block_k: int = 512,
                       num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight [N, K].T -> [M, N]: one pass over the weight, BLOCK_N rows of it
    per program, x padded to 16 rows for the tensor cores. The default tile was the fastest or
    within 2% of it for each Llama-3-8B projection and its lm_head at 1 and 8 rows on an H100
    (bench/bench_cuda_gemv.py: 1.02-1.11x cuBLAS; o_proj and lm_head gain most)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(num_rows, n)
    _small_batch_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages)
    return out


def _runs(device: torch.device, name: str, call) -> bool:
    """Whether call() (Triton kernels on tiny inputs) compiles and runs on this GPU; a warning if not."""
    try:
        call()
        torch.cuda.synchronize(device)
    except Exception as exc:  # triton's OutOfResources or CompilationError, a driver error, an old GPU
        logger.warning("Triton %s does not run on this GPU (%s: %s); torch ops instead", name,
                       type(exc).__name__, exc)
        return False
    return True


def small_ops_run_here(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the norms, silu and rotary kernels compile and run on this GPU (once, on tiny inputs),
    so a GPU or driver Triton cannot build for falls back to torch ops instead of failing at the first
    step."""
    def small_ops() -> None:
        x = torch.zeros(1, 64, dtype=dtype, device=device)
        add_rms_norm(x, x, x[0], 1e-5)
        rms_norm(x, x[0], 1e-5)
        silu_and_mul(x)
        cache = torch.zeros(1, 16, 1, 16, dtype=dtype, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        rope_and_cache(torch.zeros(1, 48, dtype=dtype, device=device), positions, x[:, :16], x[:, :16], cache, cache,
                       positions, 1, 1)

    return _runs(device, "norm, silu and rotary kernels", small_ops)


def kernels_run_here(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[bool, bool]:
    """(decode attention, small-batch matmul) usable on this GPU for this model: each compiled and run
    once on tiny inputs, since a tile can need more shared memory than an older GPU has (Triton then
    refuses at launch, where a worker would fail at its first step). The matmul is also kept to
    Hopper (compute capability 9.x), the only GPU it was measured against cuBLAS on."""
    def attention() -> None:
        cache = torch.zeros(17, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
        q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
        seq_lens = torch.full((1,), 200, dtype=torch.long, device=device)
        for width in (1, 16):  # one split and several: two compiled variants
            paged_decode_attention(q, cache, cache, torch.arange(width, device=device)[None], seq_lens.clamp(max=16 * width),
                                   0, 1.0)

    def matmul() -> None:
        small_batch_linear(torch.zeros(1, 1024, dtype=dtype, device=device),
                           torch.zeros(64, 1024, dtype=dtype, device=device))

    attention_runs = decode_attention_fits(head_dim, num_heads // num_kv_heads) and _runs(device, "decode attention", attention)
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    return attention_runs, hopper and dtype == torch.bfloat16 and _runs(device, "small-batch matmul", matmul)
