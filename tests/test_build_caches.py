"""The model worker's on-disk caches are keyed by content, not by the checkout's path: the GGUF
conversion (model_worker/model_files.py) and the C++ kernels' builds (model_worker/kernels)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from model_worker import model_files
from model_worker.model_files import _gguf_cache_key, gguf_digest


def test_the_same_gguf_at_two_paths_shares_one_conversion_and_another_does_not(tmp_path):
    cache = tmp_path / "cache"
    first = tmp_path / "venv1" / "model.gguf"
    second = tmp_path / "venv2" / "model.gguf"
    other = tmp_path / "venv3" / "model.gguf"
    for path, content in ((first, b"GGUF" + bytes(range(256)) * 4096), (second, b"GGUF" + bytes(range(256)) * 4096),
                          (other, b"GGUF" + bytes(range(255, -1, -1)) * 4096)):
        path.parent.mkdir()
        path.write_bytes(content)
    assert gguf_digest(first, cache) == hashlib.sha256(first.read_bytes()).hexdigest()
    assert _gguf_cache_key(first, cache) == _gguf_cache_key(second, cache)
    assert _gguf_cache_key(other, cache) != _gguf_cache_key(first, cache)  # same size, other bytes


def test_digests_of_files_that_are_gone_are_dropped(tmp_path):
    cache = tmp_path / "cache"
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(b"GGUF gone")
    gguf_digest(gone, cache)
    gone.unlink()
    here = tmp_path / "here.gguf"
    here.write_bytes(b"GGUF here")
    gguf_digest(here, cache)
    index = json.loads((cache / "gguf_digests.json").read_text())
    assert [key.split("|")[0] for key in index] == [str(here.resolve())]


def test_a_digest_is_read_once_per_path_size_and_mtime(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    digest = gguf_digest(gguf, cache)

    class NoHashing:
        def __init__(self, *args):
            raise AssertionError("hashed again")

    monkeypatch.setattr(model_files.hashlib, "sha256", NoHashing)
    assert gguf_digest(gguf, cache) == digest  # remembered in the cache dir
    gguf.write_bytes(b"GGUF two")  # rewritten in place: another mtime (and content)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AssertionError, match="hashed again"):
        gguf_digest(gguf, cache)


def test_a_kernel_builds_from_its_copy_in_the_build_directory_whichever_checkout_asks(tmp_path):
    """torch's build file names the source path: built from each checkout's own path, every kernel
    rebuilt whenever another checkout had built it last. The copy it builds from stays put."""
    from model_worker.kernels import _sources_in

    build_dir = tmp_path / "cache" / "tokenwire_k_0123"
    build_dir.mkdir(parents=True)
    checkouts = []
    for name in ("one", "two"):
        kernels = tmp_path / name / "kernels"
        kernels.mkdir(parents=True)
        (kernels / "k.cpp").write_text('#include "vec.h"\nint f() { return 1; }\n')
        (kernels / "vec.h").write_text("// shared\n")
        checkouts.append(kernels)
    built = _sources_in(build_dir, checkouts[0] / "k.cpp")
    assert built == build_dir / "src" / "k.cpp" and (build_dir / "src" / "vec.h").read_text() == "// shared\n"
    stamp = built.stat().st_mtime_ns
    assert _sources_in(build_dir, checkouts[1] / "k.cpp") == built
    assert built.stat().st_mtime_ns == stamp  # not rewritten: ninja would take it for an edit


def test_each_torch_install_builds_in_its_own_directory(tmp_path, monkeypatch):
    """torch's build file names torch's include directories: one build directory shared by two
    virtualenvs was rebuilt by whichever loaded after the other. Same source, same torch version,
    another install: another name."""
    import torch

    from model_worker.kernels import build_name

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "k.cpp").write_text("int f() { return 1; }\n")
    here = build_name(kernels / "k.cpp")
    assert build_name(kernels / "k.cpp") == here  # stable for one install
    other_venv = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "torch" / "__init__.py"
    monkeypatch.setattr(torch, "__file__", str(other_venv))
    there = build_name(kernels / "k.cpp")
    assert there != here and there.startswith("tokenwire_k_")


def test_a_new_build_removes_the_builds_no_process_has_loaded_for_a_month(tmp_path):
    """Every source edit, torch version and virtualenv (each CI clone's) makes a build directory;
    the ones no process has loaded for UNUSED_BUILD_MAX_AGE_S go, unless a process holds one."""
    import fcntl
    import os

    from model_worker.kernels import LAST_USED_FILE, UNUSED_BUILD_MAX_AGE_S, prune_unused_builds

    now = 1_800_000_000.0
    old = now - UNUSED_BUILD_MAX_AGE_S - 3600
    recent = now - UNUSED_BUILD_MAX_AGE_S + 3600

    def build(name: str, last_used: float | None, written: float = old) -> os.PathLike:
        build_dir = tmp_path / name
        (build_dir / "src").mkdir(parents=True)
        for file in (build_dir / f"{name}.so", build_dir / "build.ninja"):
            file.write_text("x")
            os.utime(file, (written, written))
        if last_used is not None:
            (build_dir / LAST_USED_FILE).touch()
            os.utime(build_dir / LAST_USED_FILE, (last_used, last_used))
        os.utime(build_dir, (written, written))
        return build_dir

    build("tokenwire_k_unused", old)
    build("tokenwire_k_used_lately", recent)  # built long ago, loaded this month
    build("tokenwire_k_before_markers", None, written=old)  # no last_used: its newest file's time
    build("tokenwire_k_before_markers_recent", None, written=recent)
    build("tokenwire_k_just_built", old)  # `keep`: the build this process made
    held = build("tokenwire_k_held", old)
    (tmp_path / "not_a_build").mkdir()
    os.utime(tmp_path / "not_a_build", (old, old))

    with open(held / "tokenwire.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another process building or loading it
        removed = prune_unused_builds(tmp_path, keep="tokenwire_k_just_built", now=now)
    assert removed == ["tokenwire_k_before_markers", "tokenwire_k_unused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "not_a_build", "tokenwire_k_before_markers_recent", "tokenwire_k_held", "tokenwire_k_just_built",
        "tokenwire_k_used_lately"]


def test_loading_marks_the_build_used_and_only_a_new_build_prunes(tmp_path, monkeypatch):
    """_build touches last_used on every load; it prunes its siblings only when it built (a load
    of an existing build, every start-up, scans nothing)."""
    import os
    import types

    import torch.utils.cpp_extension

    from model_worker.kernels import LAST_USED_FILE, UNUSED_BUILD_MAX_AGE_S, _build, build_name

    def fake_load(name, sources, build_directory, **kwargs):  # the compiler's work, without it
        (tmp_path / "root" / name / f"{name}.so").write_text("built")
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    monkeypatch.setenv("CXX", "true")  # any program on PATH passes the compiler check
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    root = tmp_path / "root"
    long_ago = 1_000_000_000.0

    def unused_sibling(name: str) -> None:
        (root / name).mkdir(parents=True)
        (root / name / LAST_USED_FILE).touch()
        os.utime(root / name / LAST_USED_FILE, (long_ago, long_ago))
        os.utime(root / name, (long_ago, long_ago))

    unused_sibling("tokenwire_k_000000000000")
    assert _build(source, set(), root).name == build_name(source)  # built: prunes
    assert not (root / "tokenwire_k_000000000000").exists()
    last_used = root / build_name(source) / LAST_USED_FILE
    assert last_used.is_file() and last_used.stat().st_mtime > long_ago + UNUSED_BUILD_MAX_AGE_S
    unused_sibling("tokenwire_k_111111111111")
    os.utime(last_used, (long_ago, long_ago))
    assert _build(source, set(), root) is not None  # loaded what exists: no prune
    assert (root / "tokenwire_k_111111111111").is_dir()
    assert last_used.stat().st_mtime > long_ago + UNUSED_BUILD_MAX_AGE_S  # touched again
