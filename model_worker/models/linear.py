"""A linear layer's weights, with an optional copy for small steps on CPU (weight-only int8, or bf16
packed for a streaming kernel).

On CPU the bf16 weights are kept pre-packed in oneDNN's blocked layout. F.linear with a plain
bf16 weight already runs oneDNN, but reorders the weight on every call; packing once (what
torch.compile's freezing does) gives bitwise the same results 1.2-2x faster on this project's
CPUs (SmolLM2's decode step: 1.14x at 32 streams, 1.27x at 1; bench/bench_packed_linear.py).
float32 stays on F.linear (MKL): oneDNN would be faster there too, but not bitwise equal.

At one to a few tokens a step reads every weight once and does little math, so it is bound by
memory bandwidth: int8 weights (per output channel scales) halve the bytes of bf16 and measured
2-3x faster at 1 token on this project's CPUs. From about 8 tokens on, bf16 GEMMs
(AVX512-BF16) win, so larger steps keep using the bf16 weights; the int8 copy costs half the
bf16 weights' memory again. The int8 matmul is model_worker/kernels/int8_linear.cpp where it
builds (AVX512-VNNI, weights packed in 4-row blocks: 1.4-1.6x torch's _weight_int8pack_mm over
a decode step's weights), else torch's op on the plain int8 rows.

--int4-small-batch keeps an int4 copy instead (groups of 32 columns with a float16 scale and
minimum, GGUF's Q4_1; kernels/gguf_linear.cpp, AVX512-VNNI): 0.31x bf16's bytes, and for a Q4_1
GGUF the file's own weights, found again exactly in their float32 dequantization; a Q8_0 file's
lm_head (SmolLM2's tied token_embd) likewise keeps a Q8_0 copy, 0.53x bf16's bytes. SmolLM2 decode
steps at 1 token ran 1.8x faster than on the bf16 kernel (bench/bench_gguf_linear.py).

Without int8's rounding, --bf16-small-batch keeps a second bf16 copy packed the same way, for
model_worker/kernels/bf16_linear.cpp (AVX512-BF16): it streams the weights near copy bandwidth where
oneDNN's packed matmul reaches about 0.7 of it at 1-4 rows (scratch timing; decode steps 1.4-1.5x
faster, bench/bench_bf16_linear.py), at the cost of the bf16 weights' memory again.

--cpu-bf16-matmul kernels (or auto, where a startup timing finds them fast enough) keeps the
packed copy as the only one, for every step: steps of at most 8 tokens stream it as above, larger
ones go to whichever of two matmuls on it the timing found faster:
- bf16_linear itself: the same VDPBF16PS dot products, each 4-row block (then in L1) passed over
  by x's rows 4 at a time, over panels of blocks for larger steps;
- bf16_linear_fma: each block converted to float32 once, multiplied in float32 FMAs, for CPUs
  where VDPBF16PS is slow: on this project's Intel host a core issued 0.5 VDPBF16PS a cycle (16
  multiply-adds) against 2 float32 FMAs (32), and oneDNN's bf16 matmul ran at 0.55x its float32
  one (whole SmolLM2 decode steps 1.15-1.20x faster on the FMA kernel than on oneDNN at 16-64
  streams there). It sums in VDPBF16PS's order, so the two give the same bits.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

# Steps of at most this many tokens use the int8 copy: with torch's op (its crossover with
# bf16 measured near 8 tokens), and with kernels/int8_linear.cpp (SmolLM2 decode steps at 8
# tokens: 15.0 ms against bf16's 18.8; the two meet near 12).
INT8_MAX_TOKENS = 4
INT8_KERNEL_MAX_TOKENS = 8
# torch's _weight_int8pack_mm is only safe for K (in_features) a multiple of this.
INT8_OP_K_MULTIPLE = 32
# A GGUF-format copy (Q4_1 or Q8_0, kernels/gguf_linear.cpp) has its columns in groups of this
# many, each with its own scale (and for Q4_1 minimum), and takes steps of at most
# GGUF_KERNEL_MAX_TOKENS tokens, the kernel's limit, or fewer by format: per x row they do 2-3x
# the instructions of the bf16 kernel's VDPBF16PS, so their lead in bytes runs out as rows are
# added. SmolLM2 decode steps against bf16, bench/bench_gguf_linear.py (2026-11-24): Q4_1 layers
# and the Q8_0 head at 1 / 4 / 8 tokens 1.71x / 1.22x / 0.95x; with the head stopping at 4, the
# layers at 2 / 5 / 6 / 7 / 8 tokens 1.53x / 1.16x / 1.07x / 1.00x / 0.97x.
GGUF_GROUP_COLS = 32
GGUF_KERNEL_MAX_TOKENS = 8
GGUF_FORMAT_MAX_TOKENS = {"q4_1": 6, "q8_0": 4}
# Steps of at most this many tokens use the bf16 copy's streaming matmul (kernels/bf16_linear.cpp).
# Set when it lost to oneDNN from 12 rows; that was a spill in its inner loop, and since the fix
# whole decode steps run 1.46x oneDNN's at 8 rows and 1.2x at 16 on the AMD host
# (bench/bench_bf16_linear.py, bench/bench_kernel_matmul.py). It stays at 8 for
# --cpu-bf16-matmul kernels on CPUs where VDPBF16PS is slow, which take larger steps to FMAs.
BF16_KERNEL_MAX_TOKENS = 8
# --cpu-bf16-matmul auto takes the kernels where the faster of the two, timed by
# kernel_matmul_times, runs oneDNN's product at least this fast. Below parity they still win
# overall: steps of <= 8 tokens stream the packed copy (1.3-1.5x), and whole decode steps of
# 16-64 tokens ran 1.06-1.29x faster on the AMD host, where the probe's 256-row product read
# 0.92-1.01 (a 512-token prefill 0.96x). It is a timing on a shared machine:
# --cpu-bf16-matmul kernels or onednn pins the choice.
KERNEL_MATMUL_MIN_SPEEDUP = 0.8
# The matmuls for steps over BF16_KERNEL_MAX_TOKENS on the packed copy, by name: the bf16 kernel
# module's function for each (see the module docstring).
LARGE_STEP_KERNELS = {"vdpbf16ps": "bf16_linear", "fma": "bf16_linear_fma"}
# kernels/int8_linear.cpp's and bf16_linear.cpp's packed layout: blocks of this many output rows by
# this many columns.
PACK_BLOCK_ROWS, PACK_BLOCK_COLS = 4, 32
# --batch-invariant: every GEMM has this many rows. Smaller tiles waste less on a 1-token
# decode, larger ones run prefill faster; 16 kept float32 within ~2x of the default at 32 rows.
BATCH_INVARIANT_ROW_TILE = 16


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], scales [N] in weight's dtype), symmetric per row."""
    w32 = weight.float()
    scales = w32.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    quantized = torch.round(w32 / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.contiguous(), scales.to(weight.dtype)


def pack_row_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/4), Kp/32, 4, 32], Kp = K rounded up to 32: each block of 4 output rows one
    contiguous stream, as kernels/int8_linear.cpp and bf16_linear.cpp read it (zero rows and
    columns pad)."""
    n, k = weight.shape
    padded = F.pad(weight, (0, -k % PACK_BLOCK_COLS, 0, -n % PACK_BLOCK_ROWS))
    blocks, cols = padded.shape[0] // PACK_BLOCK_ROWS, padded.shape[1] // PACK_BLOCK_COLS
    return padded.view(blocks, PACK_BLOCK_ROWS, cols, PACK_BLOCK_COLS).permute(0, 2, 1, 3).contiguous()


def _column_groups(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [N, K/32, 32]: each row's groups of GGUF_GROUP_COLS columns."""
    n, k = weight.shape
    return weight.float().reshape(n, k // GGUF_GROUP_COLS, GGUF_GROUP_COLS)


def _by_block_and_group(values: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, K/32] (N a multiple of 4) -> uint8 [N/4, K/32, 4 * itemsize]: each group's
    4 rows of a block side by side, as the packed layouts hold scales (and Q8_0's sums)."""
    blocks = values.shape[0] // PACK_BLOCK_ROWS
    return values.view(blocks, PACK_BLOCK_ROWS, -1).permute(0, 2, 1).contiguous().view(torch.uint8)


def _row_blocks(q: torch.Tensor, *per_group: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Quantized values [N, K] and per-group tensors [N, K/32], rows zero-padded to a multiple of 4
    -> (q as [N/4, K/32, 4, 32], each per-group tensor by block and group)."""
    rows = -q.shape[0] % PACK_BLOCK_ROWS
    q = F.pad(q, (0, 0, 0, rows))
    blocks, groups = q.shape[0] // PACK_BLOCK_ROWS, q.shape[1] // GGUF_GROUP_COLS
    grouped = q.view(blocks, PACK_BLOCK_ROWS, groups, GGUF_GROUP_COLS).permute(0, 2, 1, 3)
    return grouped, [_by_block_and_group(F.pad(t, (0, 0, 0, rows))) for t in per_group]


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (K a multiple of 32) -> (q uint8 [N, K] in 0..15, d, m float16 [N, K/32]):
    weight ~= d * q + m per group of 32 columns of a row, GGUF's Q4_1 (asymmetric: m the group's
    minimum, d its range / 15, both rounded to fp16 before q is found against them). A weight
    that is Q4_1 dequantized to float32 (a GGUF file's, loaded by transformers) gives back the
    file's own q, d and m."""
    groups = _column_groups(weight)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    m = low.to(torch.float16)
    d = ((high - low) / 15).to(torch.float16)
    if not (torch.isfinite(m).all() and torch.isfinite(d).all()):
        raise ValueError("Q4_1 weights: a group's minimum or range is beyond float16")
    # An all-equal group has d == 0: every q is 0 and the group is exactly m.
    step = torch.where(d > 0, d.float(), torch.ones_like(low))
    q = torch.round((groups - m.float()[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(weight.shape), d, m


def pack_q4_1_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """quantize_q4_1' output -> uint8 [ceil(N/4), K/32, 80], kernels/gguf_linear.cpp's layout:
    per block of 4 rows and group of 32 columns, row r's 16 nibble bytes at 16r (byte j: column j
    low, column j + 16 high), then the 4 rows' d and the 4 rows' m as float16 (padding rows are
    zeros)."""
    grouped, scales = _row_blocks(q, d, m)  # [B, G, 4, 32]; d and m each [B, G, 8]: 4 float16s
    nibbles = (grouped[..., :16] | (grouped[..., 16:] << 4)).reshape(*grouped.shape[:2], 64)
    return torch.cat([nibbles, *scales], dim=2).contiguous()


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (K a multiple of 32) -> (q int8 [N, K] in -127..127, d float16 [N, K/32]):
    weight ~= d * q per group of 32 columns of a row, GGUF's Q8_0 (d the group's max |w| / 127,
    rounded to fp16 before q is found against it). A Q8_0 weight dequantized to float32 gives back
    the file's own q and d."""
    groups = _column_groups(weight)
    d = (groups.abs().amax(dim=2) / 127).to(torch.float16)
    if not torch.isfinite(d).all():
        raise ValueError("Q8_0 weights: a group's largest value is beyond float16")
    step = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    q = torch.round(groups / step[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape), d


def pack_q8_0_blocks(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """quantize_q8_0's output -> uint8 [ceil(N/4), K/32, 144], kernels/gguf_linear.cpp's layout: per
    block of 4 rows and group of 32 columns, the 4 rows' 32 int8 each, their d as float16, and each
    row's sum of q as int16 (the kernel's offset correction; padding rows are zeros)."""
    sums = _column_groups(q).sum(dim=2).to(torch.int16)  # [N, K/32]; |sum| <= 32 * 127, exact in float32
    grouped, (scales, sum_bytes) = _row_blocks(q, d, sums)  # [B, G, 4, 32]; [B, G, 8] each
    return torch.cat([grouped.reshape(*grouped.shape[:2], 128).view(torch.uint8), scales, sum_bytes],
                     dim=2).contiguous()


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 d * q + m, as transformers dequantizes a Q4_1 tensor."""
    return (_column_groups(q) * d.float()[..., None] + m.float()[..., None]).view(q.shape)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 d * q, as transformers dequantizes a Q8_0 tensor."""
    return (_column_groups(q) * d.float()[..., None]).view(q.shape)


# The GGUF formats a Linear keeps a small-step copy in: (quantize, dequantize, pack, the kernel
# module's matmul).
GGUF_FORMATS = {"q4_1": (quantize_q4_1, dequantize_q4_1, pack_q4_1_blocks, "q4_1_linear"),
                "q8_0": (quantize_q8_0, dequantize_q8_0, pack_q8_0_blocks, "q8_0_linear")}


def gguf_supported(weight: torch.Tensor) -> bool:
    """Whether a layer takes a GGUF-format small-step copy: a CPU weight whose columns split into groups of 32."""
    return weight.device.type == "cpu" and weight.shape[1] % GGUF_GROUP_COLS == 0


def small_batch_supported(weight: torch.Tensor) -> bool:
    """Whether the small-step copies (int8 or bf16) apply: bf16 weights on the CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


# The GEMM row count oneDNN picks the packed layout for; measured within 1-3% of a
# per-size layout from 1 to 512 rows for bf16.
PACK_ROWS_HINT = 32


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] -> the same weight in oneDNN's blocked layout for
    torch.ops.mkldnn._linear_pointwise, or None where that does not apply (not a bf16 CPU
    tensor, a torch build without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    except (RuntimeError, AttributeError):  # an op this torch build lacks: stay on F.linear
        return None


class Linear:
    """y [T, N] = x [T, K] @ weight [N, K]^T (+ bias); `weight` is None when only the packed copy is kept."""

    __slots__ = ("weight", "packed_weight", "bias", "small_batch_matmul", "small_batch_max_tokens",
                 "int8_weight", "int8_scales", "int8_matmul", "int8_max_tokens", "gguf_blocks", "gguf_matmul",
                 "gguf_max_tokens", "gguf_exact", "bf16_blocks", "bf16_matmul", "bf16_max_tokens", "bf16_large",
                 "out_features", "in_features", "row_tile")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, int8_small_batch: bool = False,
                 row_tile: int = 0, int8_kernel: ModuleType | None = None, bf16_kernel: ModuleType | None = None,
                 bf16_large_steps: str = "onednn", gguf_kernel: ModuleType | None = None,
                 gguf_source: torch.Tensor | None = None, gguf_format: str = "q4_1"):
        """int8_kernel: kernels.int8_linear_module(), or None for torch's int8 op. bf16_kernel:
        kernels.bf16_linear_module() to keep the packed bf16 copy for small steps, or None.
        bf16_large_steps: the matmul of larger steps: "onednn", or (with bf16_kernel) one of
        LARGE_STEP_KERNELS on the packed copy, and then no oneDNN copy is kept.
        gguf_kernel: kernels.gguf_linear_module() to keep a copy in gguf_format (a key of
        GGUF_FORMATS: Q4_1 for --int4-small-batch's layers, Q8_0 for a Q8_0 file's lm_head) for
        steps of at most GGUF_FORMAT_MAX_TOKENS[gguf_format] tokens, where the layer's columns come in groups of
        32 (else it has none); gguf_source: the weight to quantize, in its loaded precision (a
        GGUF's weights come back exactly from float32, not always from bf16), else `weight`."""
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        # > 0: batch-invariant mode, every GEMM has exactly row_tile rows (see _tiled).
        self.row_tile = row_tile
        # CUDA: steps of up to small_batch_max_tokens rows on triton_ops.small_batch_linear (set by
        # ModelRunner), which reads the weight at 1.02-1.11x cuBLAS's rate at 1-8 rows on an H100.
        self.small_batch_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.small_batch_max_tokens = 0
        self.int8_weight = self.int8_scales = self.int8_matmul = None
        self.int8_max_tokens = 0
        if (int8_small_batch or gguf_kernel is not None) and row_tile:
            raise ValueError("small-batch int8 or GGUF-format weights switch kernels with the step's size; "
                             "not batch-invariant")
        if int8_small_batch and gguf_kernel is not None:
            raise ValueError("a layer's small steps take int8 or GGUF-format weights, not both")
        if gguf_format not in GGUF_FORMATS:
            raise ValueError(f"gguf_format {gguf_format!r}: one of {sorted(GGUF_FORMATS)}")
        self.gguf_blocks = self.gguf_matmul = None
        self.gguf_max_tokens = 0
        # Whether the GGUF-format copy holds exactly the source's values (a GGUF's own blocks
        # found again), or rounded them (another model's weights; a Q4_1 file quantized with an
        # importance matrix, whose q need not span 0..15 in a group).
        self.gguf_exact = False
        if gguf_kernel is not None and gguf_supported(weight):
            if not small_batch_supported(weight):
                raise ValueError("GGUF-format small-batch weights need bfloat16 weights on the CPU")
            quantize, dequantize, pack, matmul = GGUF_FORMATS[gguf_format]
            source = (weight if gguf_source is None else gguf_source).float()
            quantized = quantize(source)
            self.gguf_exact = torch.equal(dequantize(*quantized), source)
            self.gguf_blocks = pack(*quantized)
            self.gguf_matmul, self.gguf_max_tokens = getattr(gguf_kernel, matmul), GGUF_FORMAT_MAX_TOKENS[gguf_format]
        # torch's int8 op (where the C++ kernel is not built) crashes the process or returns
        # values near 1e36 for some shapes whose K is not a multiple of 32 (torch 2.13): such a
        # layer keeps no int8 copy there, and its small steps run in bf16.
        if int8_small_batch and not small_batch_supported(weight):
            raise ValueError("int8 small-batch weights need bfloat16 weights on the CPU")
        int8_copy = int8_small_batch and (int8_kernel is not None or self.in_features % INT8_OP_K_MULTIPLE == 0)
        # Small steps on an int8 copy, or up to its own limit on a GGUF-format copy; the bf16
        # weights serve the rest (the bf16 kernel's streaming matmul the steps between).
        quantized_small = int8_small_batch or self.gguf_blocks is not None
        if int8_copy:
            self.int8_weight, self.int8_scales = quantize_int8_per_channel(weight)
            if int8_kernel is not None:
                self.int8_weight = pack_row_blocks(self.int8_weight)
                self.int8_matmul, self.int8_max_tokens = int8_kernel.int8_linear, INT8_KERNEL_MAX_TOKENS
            else:
                self.int8_matmul, self.int8_max_tokens = torch.ops.aten._weight_int8pack_mm, INT8_MAX_TOKENS
        self.bf16_blocks = self.bf16_matmul = self.bf16_large = None
        self.bf16_max_tokens = 0
        if bf16_large_steps != "onednn" and (bf16_kernel is None or bf16_large_steps not in LARGE_STEP_KERNELS):
            raise ValueError(f"bf16_large_steps {bf16_large_steps!r}: onednn, or one of {sorted(LARGE_STEP_KERNELS)} "
                             "with the bf16 kernel module")
        if bf16_kernel is not None:
            if row_tile or (quantized_small and bf16_large_steps == "onednn"):
                raise ValueError("bf16 small-batch weights are neither for int8 / GGUF small-batch nor "
                                 "batch-invariant layers")
            if not small_batch_supported(weight):
                raise ValueError("bf16 small-batch weights need bfloat16 weights on the CPU")
            self.bf16_blocks = pack_row_blocks(weight)
            if not int8_copy:  # with int8 small-step weights, the packed copy serves larger steps only
                self.bf16_matmul, self.bf16_max_tokens = bf16_kernel.bf16_linear, BF16_KERNEL_MAX_TOKENS
            if bf16_large_steps != "onednn":
                self.bf16_large = getattr(bf16_kernel, LARGE_STEP_KERNELS[bf16_large_steps])
        # Batch-invariant mode keeps the plain GEMMs it was validated with.
        self.packed_weight = None if row_tile or self.bf16_large is not None else pack_for_onednn(weight)
        if self.packed_weight is not None or self.bf16_large is not None:
            # The packed copy is the only one needed: keeping both would double the weights'
            # memory (a tied lm_head's plain weight lives on as the embedding table).
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile:
            return self._tiled(x)
        if 0 < x.shape[0] <= self.small_batch_max_tokens:
            y = self.small_batch_matmul(x, self.weight)
            return y if self.bias is None else y + self.bias
        if 0 < x.shape[0] <= self.int8_max_tokens:
            y = self.int8_matmul(x, self.int8_weight, self.int8_scales)
            return y if self.bias is None else y + self.bias
        if 0 < x.shape[0] <= self.gguf_max_tokens:
            return self.gguf_matmul(x, self.gguf_blocks, self.out_features, self.bias)
        if 0 < x.shape[0] <= self.bf16_max_tokens:
            return self.bf16_matmul(x, self.bf16_blocks, self.out_features, self.in_features, self.bias)
        if self.bf16_large is not None:
            return self.bf16_large(x, self.bf16_blocks, self.out_features, self.in_features, self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N] as GEMMs of exactly row_tile rows (the last zero-padded).

        BLAS picks its blocking, kernels and K-splitting from the matrix shape, so a row's
        result depends on how many rows share its GEMM; with one fixed shape every call takes
        the same path, and a row's dot products do not read the tile's other rows
        (bench/batch_invariance_probe.py checks that on this CPU, tests/test_batch_invariant.py
        in the suite).
        """
        num_tokens, tile = x.shape[0], self.row_tile
        if num_tokens == 0:  # a step where no chunk completes its sequence
            return F.linear(x, self.weight, self.bias)
        padded = -(-num_tokens // tile) * tile
        x = F.pad(x, (0, 0, 0, padded - num_tokens)) if padded != num_tokens else x.contiguous()  # [T', K]
        tiles = [F.linear(x[start:start + tile], self.weight, self.bias) for start in range(0, padded, tile)]
        return torch.cat(tiles)[:num_tokens]  # [T, N]


def kernel_matmul_times(bf16_kernel: ModuleType, rows: int = 256, features: int = 1024,
                        trials: int = 9) -> dict[str, float]:
    """Seconds for one [rows, features] x [features, features] bf16 product on oneDNN's packed
    matmul ("onednn") and on each of LARGE_STEP_KERNELS: the best of `trials` runs each, taken in
    turn so that all see the same machine load (~0.1 s in all). "onednn" is inf where there is no
    oneDNN (F.linear on bf16 would be slower still). 256 rows, where the FMA kernel and oneDNN
    differ most on the Intel host (1.12-1.37x over 5 idle probes; 64 rows read 1.01-1.27, and
    0.94 once while the rest of the stack started beside it)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(features, features, generator=generator) * 0.03).to(torch.bfloat16)
    x = torch.randn(rows, features, generator=generator).to(torch.bfloat16)
    blocks = pack_row_blocks(weight)
    runs = {name: functools.partial(getattr(bf16_kernel, function), x, blocks, features, features, None)
            for name, function in LARGE_STEP_KERNELS.items()}
    packed = pack_for_onednn(weight)
    if packed is not None:
        runs["onednn"] = functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
    best = dict.fromkeys([*runs, "onednn"], float("inf"))
    for trial in range(trials + 1):  # round 0 warms them up and is not counted
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if trial:
                best[name] = min(best[name], time.perf_counter() - start)
    return best
