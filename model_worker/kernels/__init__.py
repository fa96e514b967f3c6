"""CPU kernels torch does not ship, compiled from C++ at first use and cached on disk.

torch.utils.cpp_extension builds each source with the host's compiler (-march=native) under
`<cache dir>/kernels` (the model worker's --cache-dir, so a mounted cache volume keeps the
build), ~20 s once per machine and source version. Where that cannot happen (no compiler or
ninja, a CPU without the instructions a kernel is written for, a read-only cache), the loader
returns None and the model keeps its torch-ops path, which computes the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from model_worker.config import DEFAULT_CACHE_DIR

logger = logging.getLogger(__name__)

PAGED_DECODE_ATTENTION_SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")
INT8_LINEAR_SOURCE = Path(__file__).with_name("int8_linear.cpp")
GGUF_LINEAR_SOURCE = Path(__file__).with_name("gguf_linear.cpp")
BF16_LINEAR_SOURCE = Path(__file__).with_name("bf16_linear.cpp")
LLAMA_OPS_SOURCE = Path(__file__).with_name("llama_ops.cpp")
SAMPLING_OPS_SOURCE = Path(__file__).with_name("sampling_ops.cpp")
DEFAULT_BUILD_ROOT = DEFAULT_CACHE_DIR / "kernels"  # the model worker's default --cache-dir
# A build directory no process has loaded for this long is removed when a new build is made beside
# it: each source edit, torch version or virtualenv (a CI clone's) makes a new one, ~1 MB each.
UNUSED_BUILD_MAX_AGE_S = 30 * 24 * 3600
LAST_USED_FILE = "last_used"  # touched on every load: its mtime is the build's last use
# The CPU flags gguf_linear.cpp is written for (--int4-small-batch auto looks for them too).
GGUF_LINEAR_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An flock on `path`: the OS drops it when its process dies, unlike torch's lock file."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock is all there is
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_name(source: Path) -> str:
    """The module's (and its build directory's) name. It carries the source and the headers beside
    it (which any kernel may include), torch's version and the CPU's flags: an edit rebuilds, and a
    cache shared with a machine of another CPU (a baked image, a network home) never loads a
    -march=native build made for different instructions. And where torch is installed: torch's
    build file names its include directories, so one build directory shared by two virtualenvs
    (a checkout's and a CI clone's) was rebuilt, ~17 s a kernel, by whichever loaded after the other."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + torch.__version__.encode()
                            + " ".join(sorted(cpu_flags())).encode()
                            + str(Path(torch.__file__).resolve().parent).encode())
    return f"tokenwire_{source.stem}_{digest.hexdigest()[:12]}"


def _sources_in(build_dir: Path, source: Path) -> Path:
    """The source and the headers beside it, copied into the build directory once; the copy is
    what gets built. torch's build file names the source's path, so building from each checkout's
    own path rebuilt every kernel (~17 s each) whenever another checkout (a CI clone, a worktree)
    had built it last. The directory's name carries their content, so a copy never goes stale,
    and it is never rewritten (a newer copy would read as an edit to ninja)."""
    copies = build_dir / "src"
    copies.mkdir(exist_ok=True)
    for path in (source, *sorted(source.parent.glob("*.h"))):
        copy = copies / path.name
        if not copy.exists():
            shutil.copyfile(path, copy)
    return copies / source.name


def _last_used(build_dir: Path) -> float:
    """When a process last loaded this build; for one made before the marker existed, when its
    newest file was written."""
    try:
        return (build_dir / LAST_USED_FILE).stat().st_mtime
    except OSError:
        return max((p.stat().st_mtime for p in build_dir.iterdir()), default=build_dir.stat().st_mtime)


def prune_unused_builds(build_root: Path, keep: str, max_age_s: float = UNUSED_BUILD_MAX_AGE_S,
                        now: float | None = None) -> list[str]:
    """Removes the kernel build directories under build_root that no process has loaded for
    max_age_s (every one but `keep`, the build just made); returns their names. Age and not
    "its torch install is gone" decides, because a cache may be shared with a machine or container
    whose paths this one cannot see. One another process holds (building or loading it) stays."""
    try:
        import fcntl
    except ImportError:
        return []
    now = time.time() if now is None else now
    removed = []
    for build_dir in sorted(build_root.glob("tokenwire_*")):
        try:
            if build_dir.name == keep or not build_dir.is_dir() or now - _last_used(build_dir) < max_age_s:
                continue
            with open(build_dir / "tokenwire.flock", "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: in use, keep it
                shutil.rmtree(build_dir)
            removed.append(build_dir.name)
        except OSError as exc:
            logger.debug("kept %s: %s", build_dir, exc)
    if removed:
        logger.info("removed %d kernel builds unused for %d days from %s", len(removed), max_age_s // 86400,
                    build_root)
    return removed


def can_build(required_flags: set[str]) -> bool:
    """Whether a kernel written for these CPU flags can be built here: the CPU has them and a C++
    compiler is on PATH (what _build checks before it tries; the tests skip on the same)."""
    return required_flags <= cpu_flags() and shutil.which(os.environ.get("CXX", "c++")) is not None


def _build(source: Path, required_flags: set[str], build_root: Path) -> ModuleType | None:
    if not source.is_file():  # an install that left the sources out
        logger.warning("%s is missing; using torch ops", source)
        return None
    flags = cpu_flags()
    if not required_flags <= flags:
        logger.info("%s: this CPU lacks %s; using torch ops", source.name, sorted(required_flags - flags))
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        logger.info("%s: no C++ compiler (%s) on PATH; using torch ops", source.name, compiler)
        return None
    name = build_name(source)
    build_dir = build_root / name
    try:
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(build_dir / "tokenwire.flock"):
            # torch takes `lock` around every load, and one left by a process killed mid-build
            # makes every later load wait on it forever. Under the flock no live loader holds
            # it, so any found here is stale.
            (build_dir / "lock").unlink(missing_ok=True)
            (build_dir / LAST_USED_FILE).touch()
            builds = not (build_dir / f"{name}.so").exists()
            if builds:
                logger.info("building %s in %s (once per machine and version, ~20 s)", source.name, build_dir)
            module = load(name=name, sources=[str(_sources_in(build_dir, source))], build_directory=str(build_dir),
                          extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                          verbose=False)
        if builds:  # a new build sits beside the old ones: the time to drop those long unused
            prune_unused_builds(build_root, keep=name)
    except Exception as exc:  # no ninja, a compile error, a read-only cache: stay on torch ops
        text = str(exc).strip()
        logger.warning("%s: could not build (%s: %s); using torch ops", source.name, type(exc).__name__,
                       text.splitlines()[-1] if text else "")
        logger.debug("%s build failure in full:\n%s", source.name, text)
        return None
    logger.info("%s: using the C++ kernel (%s)", source.name, build_dir)
    return module


def paged_decode_attention_fits(head_dim: int, query_heads_per_kv_head: int) -> bool:
    """Shapes paged_decode_attention.cpp takes (it refuses others with an error)."""
    return head_dim % 32 == 0 and head_dim <= 128 and query_heads_per_kv_head <= 16


def _vectorized_module(source: Path, required_flags: set[str], build_root: Path, what: str) -> ModuleType | None:
    """The built module, or None where it cannot be built or compiled without its instructions."""
    module = _build(source, required_flags, build_root)
    if module is not None and not module.vectorized():
        logger.warning("%s compiled without %s; using torch ops", source.name, what)
        return None
    return module


@functools.cache
def paged_decode_attention_module(build_root: Path = DEFAULT_BUILD_ROOT) -> ModuleType | None:
    """The AVX512-BF16 paged decode attention (paged_decode_attention.cpp), or None."""
    return _vectorized_module(PAGED_DECODE_ATTENTION_SOURCE, {"avx512f", "avx512_bf16"}, build_root, "AVX512-BF16")


@functools.cache
def int8_linear_module(build_root: Path = DEFAULT_BUILD_ROOT) -> ModuleType | None:
    """The AVX512-VNNI weight-only int8 matmul for small steps (int8_linear.cpp), or None."""
    return _vectorized_module(INT8_LINEAR_SOURCE, {"avx512f", "avx512bw", "avx512_vnni"}, build_root,
                              "AVX512-BW/VNNI")


@functools.cache
def gguf_linear_module(build_root: Path = DEFAULT_BUILD_ROOT) -> ModuleType | None:
    """The AVX512-VNNI matmuls on GGUF's Q4_1 and Q8_0 blocks for small steps (gguf_linear.cpp), or None."""
    return _vectorized_module(GGUF_LINEAR_SOURCE, set(GGUF_LINEAR_FLAGS), build_root, "AVX512-BW/VNNI")


@functools.cache
def bf16_linear_module(build_root: Path = DEFAULT_BUILD_ROOT) -> ModuleType | None:
    """The AVX512-BF16 bf16 matmul for small steps on packed weights (bf16_linear.cpp), or None."""
    return _vectorized_module(BF16_LINEAR_SOURCE, {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"},
                              build_root, "AVX512-BF16")


@functools.cache
def llama_ops_module(build_root: Path = DEFAULT_BUILD_ROOT) -> ModuleType | None:
    """The Llama forward's AVX512-BF16 per-layer ops on bf16 rows (llama_ops.cpp: RMSNorm, residual
    add + RMSNorm, rotary embedding + KV cache write, silu(gate) * up), or None."""
    return _vectorized_module(LLAMA_OPS_SOURCE, {"avx512f", "avx512_bf16"}, build_root, "AVX512-BF16")


@functools.cache
def sampling_ops_module(build_root: Path = DEFAULT_BUILD_ROOT) -> ModuleType | None:
    """The sampler's AVX-512 greedy pick (sampling_ops.cpp: argmax of float32 rows), or None."""
    return _vectorized_module(SAMPLING_OPS_SOURCE, {"avx512f"}, build_root, "AVX-512")
