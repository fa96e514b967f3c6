"""glibc malloc settings for the model worker's host memory.

A CPU decode step allocates and frees the same few large tensors every step (logits of
rows x vocab, attention scratch, gathered KV blocks: 0.1-10 MB each). glibc serves blocks
above its mmap threshold (128 KiB, raised only dynamically) with a fresh mmap and returns
them with munmap, so every step page-faults its scratch memory in again: on SmolLM2-135M at
32 streams that was a quarter of the worker's CPU time spent in the kernel and a 3-4x
spread in step times. Keeping freed blocks in the heap makes the next step reuse them
(what tcmalloc/jemalloc, which Intel and vLLM's CPU docs suggest preloading, do too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# Blocks up to this size come from the heap; larger ones (a long prefill's activations) still
# get their own mmap and go back to the OS when freed.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30  # give memory back to the OS only when a whole GiB is free at the top
TOP_PAD_BYTES = 64 << 20  # grow the heap in 64 MiB steps, not one brk per allocation


def keep_freed_memory_in_heap() -> bool:
    """Sets the thresholds above; False (and a debug line) where libc has no mallopt, e.g. musl."""
    path = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(path).mallopt if path else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.debug("no glibc mallopt here; host malloc left at its defaults")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, TOP_PAD_BYTES)))
    if not applied:
        logger.warning("mallopt refused a setting; host malloc may page-fault its scratch memory every step")
    return applied
