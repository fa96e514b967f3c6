"""The model worker's glibc malloc settings (model_worker/host_memory.py)."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from model_worker import host_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_every_setting():
    # mallopt answers 0 to a value it refuses, so True means every threshold is in force.
    assert host_memory.keep_freed_memory_in_heap() is True


def test_without_mallopt_it_reports_false(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert host_memory.keep_freed_memory_in_heap() is False
