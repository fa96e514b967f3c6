"""The model worker's glibc malloc settings (model_worker/host_memory.py)."""

from __future__ import annotations

import ctypes.util
import os
import platform
import subprocess
import sys

import pytest

from model_worker import host_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_every_setting():
    # mallopt answers 0 to a value it refuses, so True means every threshold is in force.
    assert host_memory.keep_freed_memory_in_heap() is True


def test_without_mallopt_it_reports_false(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert host_memory.keep_freed_memory_in_heap() is False


# Runs in a fresh interpreter: torch reads the cache bounds once, when it loads. Packed bf16
# GEMMs over 400 row counts; prints the RSS growth (MiB) over the even ones, after the odd ones
# warmed up with entries of the same sizes.
_SHAPE_SWEEP = """
import os, sys
import model_worker  # before torch, as `python -m model_worker` imports it
import torch
from model_worker.models.linear import Linear
torch.set_num_threads(1)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
layer = Linear(torch.randn(1536, 576, dtype=torch.bfloat16))
x = torch.randn(500, 576, dtype=torch.bfloat16)
assert layer.packed_weight is not None
for rows in range(101, 501, 2):
    layer(x[:rows])
before = rss()
for rows in range(102, 501, 2):
    layer(x[:rows])
print(os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], rss() - before)
"""


def _shape_sweep(env: dict[str, str]) -> tuple[str, str, float]:
    clean = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", _SHAPE_SWEEP], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120, check=True)
    lru, onednn, growth = done.stdout.split()
    return lru, onednn, float(growth)


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/statm")
def test_onednn_shape_caches_are_bounded_so_ragged_steps_do_not_grow_memory():
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("a torch build without oneDNN")
    lru, onednn, bounded_growth = _shape_sweep({})
    assert (lru, onednn) == ("64", "64")  # the package's defaults reached torch's environment
    *_, unbounded_growth = _shape_sweep({"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"})
    # torch's defaults keep an entry per new row count (~1 MB each here); the bounds evict.
    assert unbounded_growth > 100, unbounded_growth
    assert bounded_growth < unbounded_growth / 4, (bounded_growth, unbounded_growth)
