"""CPU kernels torch does not ship, compiled from C++ at first use and cached on disk.

torch.utils.cpp_extension builds each source with the host's compiler (-march=native) into
torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), ~20 s once
per machine and source version. Where that cannot happen (no compiler or ninja, a CPU without
the instructions a kernel is written for), the loader returns None and the model keeps its
torch-ops path, which computes the same thing.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

PAGED_DECODE_ATTENTION_SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(source: Path, required_flags: set[str]) -> ModuleType | None:
    if not source.is_file():  # an install that left the sources out
        logger.warning("%s is missing; using torch ops", source)
        return None
    flags = cpu_flags()
    if not required_flags <= flags:
        logger.info("%s: this CPU lacks %s; using torch ops", source.name, sorted(required_flags - flags))
        return None
    # The name carries the source, torch's version and the CPU's flags: a cache shared with a
    # machine of another CPU (a baked image, a network home) never loads a -march=native build
    # made for different instructions.
    digest = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + " ".join(sorted(flags)).encode())
    name = f"tokenwire_{source.stem}_{digest.hexdigest()[:12]}"
    try:
        from torch.utils.cpp_extension import load

        return load(name=name, sources=[str(source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler or ninja, a compile error: stay on torch ops
        logger.warning("%s: could not build (%s: %s); using torch ops", source.name, type(exc).__name__,
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


@functools.cache
def paged_decode_attention_module() -> ModuleType | None:
    """The AVX512-BF16 paged decode attention (paged_decode_attention.cpp), or None."""
    module = _build(PAGED_DECODE_ATTENTION_SOURCE, {"avx512f", "avx512_bf16"})
    if module is not None and not module.vectorized():
        logger.warning("%s compiled without AVX512-BF16; using torch ops", PAGED_DECODE_ATTENTION_SOURCE.name)
        return None
    return module
