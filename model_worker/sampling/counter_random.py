"""Counter-based random numbers: every uniform is a hash of (key, column), never a generator's state.

A request's draws are keyed by (seed, sample index, output position, stream), so they do not depend
on which other requests share the batch, on the row they sit in, or on how many steps ran before.
"""

from __future__ import annotations

import torch

# Constants as int32 bit patterns: the hash runs on int32 tensors (half the memory traffic of
# int64), whose products wrap modulo 2**32 as the hash wants.
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)
_GOLDEN32 = 0x9E3779B9 - (1 << 32)

# Streams keep a row's independent draws at one position apart (the token draw, XTC's coin).
STREAM_TOKEN = 0
STREAM_XTC = 1


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (>> sign-extends negatives)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) on int32 tensors (bit patterns)."""
    x = x ^ _shr(x, 16)
    x = x * _M1
    x = x ^ _shr(x, 15)
    x = x * _M2
    return x ^ _shr(x, 16)


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, sample_index: torch.Tensor, position: torch.Tensor,
             stream: int) -> torch.Tensor:
    """[S] int64 each (seed halves in [0, 2**32)) -> [S] int32 keys, one per (seed, sample index,
    position, stream)."""
    key = mix32(seed_lo.to(torch.int32) ^ _GOLDEN32)
    key = mix32(key ^ seed_hi.to(torch.int32))
    key = mix32(key ^ sample_index.to(torch.int32))
    key = mix32(key ^ position.to(torch.int32))
    return mix32(key ^ stream)


def column_counters(num_columns: int, device: torch.device) -> torch.Tensor:
    """[V] int32: column j's counter, spread over 32 bits so neighbouring columns differ in many bits."""
    return torch.arange(num_columns, dtype=torch.int32, device=device) * _GOLDEN32


def _uniform_bits(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """keys [S], columns [C] int32 -> [S, C] int32 in [0, 2**24): a two-round multiply-xorshift of
    key ^ column, keeping the top 24 bits (the best mixed). Lighter than mix32, since it runs over
    every logit; the row keys that feed it are fully mixed. In place on one buffer, with one
    scratch: fresh [S, V] allocations cost a page fault per page on CPU."""
    x = keys[:, None] ^ columns[None, :]
    scratch = torch.empty_like(x)
    x.mul_(_M1)
    torch.bitwise_right_shift(x, 15, out=scratch)
    x.bitwise_xor_(scratch.bitwise_and_((1 << 17) - 1))
    x.mul_(_M2)
    torch.bitwise_right_shift(x, 8, out=scratch)
    return scratch.bitwise_and_((1 << 24) - 1)


def uniforms(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """keys [S], columns [C] int32 -> uniforms [S, C] float32 in (0, 1), 24 bits each."""
    # (2**24 - 1) + 0.5 rounds to 2**24 in float32, so u would be exactly 1 and its Gumbel noise +inf:
    # that column would be drawn even where a filter or grammar mask set -inf (NaN wins argmax).
    return _uniform_bits(keys, columns).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24)).clamp_(max=1.0 - 2.0**-24)


def gumbel_noise(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """[S, C] Gumbel(0, 1): argmax(logits + noise) draws from softmax(logits) (the Gumbel-max trick,
    the same race as argmax(p / Exp(1)) without computing p)."""
    return uniforms(keys, columns).log_().neg_().log_().neg_()
