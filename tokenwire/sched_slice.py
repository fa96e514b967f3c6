"""Short CPU time slices for the serving threads, so a token in flight gets a core quickly.

On a host where the engine's threads keep every core busy (torch's OpenMP threads compute, then
spin), each hop of a token (model worker -> gateway -> detok worker -> gateway -> client) is a
thread that wakes and needs a core. Linux's EEVDF scheduler (6.6+) lets the running thread
finish its protected slice first (~1.4 ms on the 2-core host) unless the woken one asked for a
shorter slice; since 6.12 a thread can ask, through sched_setattr's sched_runtime for
SCHED_OTHER, with no privilege. The services ask for --sched-slice-us on their serving threads:
the gateway and the detok worker for all of theirs, the model worker for its event loop and the
threads created after it, not the engine's (see model_worker/__main__.py). CPU shares do not
change: a short slice only means being picked sooner, for less time at a go.

Measured on the 2-core host (bench.ttft_added, 100 requests, alternating stacks): the first
token's added latency fell ~1 ms at p50; throughput at 32 streams did not move beyond noise
(README, Performance).

Elsewhere (not Linux, an older kernel, a seccomp filter without the call) the request is a
no-op: the kernel ignores sched_runtime for SCHED_OTHER before 6.12, and an error is logged at
debug level.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import struct
import sys
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# sched_setattr / sched_getattr syscall numbers by architecture (no libc wrapper before glibc 2.41).
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
# struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes): size, policy, flags, nice, priority, runtime,
# deadline, period, util_min, util_max.
_SCHED_ATTR = struct.Struct("IIqiIQQQII")
SCHED_OTHER = 0
# The kernel clamps a custom slice to 0.1-100 ms.
MIN_SLICE_US, MAX_SLICE_US = 100, 100_000


@dataclass
class SchedSliceOption:
    """The flag every service shares (each Config inherits it)."""

    sched_slice_us: int = field(default=MIN_SLICE_US, metadata={
        "help": "CPU time slice (us) the service's serving threads ask Linux (6.12+) for: a token waiting on a busy "
                "core is picked sooner. 100-100000; 0: the kernel's default"})

    def __post_init__(self) -> None:
        if self.sched_slice_us and not MIN_SLICE_US <= self.sched_slice_us <= MAX_SLICE_US:
            raise ValueError(f"--sched-slice-us must be 0 or {MIN_SLICE_US}..{MAX_SLICE_US}, not {self.sched_slice_us}")


def _syscall_numbers() -> tuple[int, int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return _SYSCALLS.get(platform.machine())


def _sched_attr(thread_id: int) -> list | None:
    """A thread's struct sched_attr fields (0: the calling thread), or None where they cannot be read."""
    numbers = _syscall_numbers()
    if numbers is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if libc.syscall(numbers[1], thread_id, buf, _SCHED_ATTR.size, 0) != 0:
        logger.debug("sched_getattr failed (errno %d)", ctypes.get_errno())
        return None
    return list(_SCHED_ATTR.unpack(buf.raw))


def thread_slice_ns(thread_id: int = 0) -> int | None:
    """A thread's (0: the calling one's) time slice in ns as the kernel reports it (its default
    where none was asked for), or None where it cannot be read."""
    fields = _sched_attr(thread_id)
    return None if fields is None else fields[5]


def request_thread_slice(slice_us: int, thread_id: int = 0) -> bool:
    """Asks for a `slice_us` time slice for a thread (0: the calling one), which the threads it
    creates afterwards inherit; 0 restores the kernel's default. Only SCHED_OTHER threads are
    changed. True when the kernel took the request (it ignores it before 6.12)."""
    fields = _sched_attr(thread_id)
    if fields is None or fields[1] != SCHED_OTHER:
        return False
    fields[0], fields[2], fields[5] = _SCHED_ATTR.size, 0, slice_us * 1000
    request = ctypes.create_string_buffer(_SCHED_ATTR.pack(*fields), _SCHED_ATTR.size)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_syscall_numbers()[0], thread_id, request, 0) != 0:
        logger.debug("sched_setattr(sched_runtime=%d us) failed (errno %d); keeping the default time slice",
                     slice_us, ctypes.get_errno())
        return False
    return True


def use_serving_slice(config: SchedSliceOption, what: str, whole_process: bool) -> None:
    """Applies config.sched_slice_us to the calling thread and the threads it creates later, and
    with whole_process to the process's other threads too (those a library started at import)."""
    if not config.sched_slice_us:
        return
    thread_ids = [0]
    if whole_process:
        with contextlib.suppress(OSError):
            thread_ids += [int(t) for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
    if all([request_thread_slice(config.sched_slice_us, t) for t in thread_ids]):
        logger.info("%s: serving threads ask for %d us CPU time slices", what, config.sched_slice_us)
