"""Little-endian packing of token ids and logprobs for the wire's bytes fields.

Every service packs and unpacks frames through these, so the byte layout the proto
comments promise (int32 / float32 little-endian) lives in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")


def pack_int32(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=INT32).tobytes()


def pack_float32(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=FLOAT32).tobytes()


def unpack_int32(buf: bytes) -> np.ndarray:
    """Read-only int32 view of buf; no copy."""
    if len(buf) % 4:
        raise ValueError(f"int32 field has {len(buf)} bytes, not a multiple of 4")
    return np.frombuffer(buf, dtype=INT32)


def unpack_float32(buf: bytes) -> np.ndarray:
    if len(buf) % 4:
        raise ValueError(f"float32 field has {len(buf)} bytes, not a multiple of 4")
    return np.frombuffer(buf, dtype=FLOAT32)


def unpack_int32_list(buf: bytes) -> list[int]:
    return unpack_int32(buf).tolist()
