"""The one-host launcher leaves a core to the gateway and detok workers."""

from __future__ import annotations

import pytest

from tokenwire import stack


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (16, 15), (None, 1)])
def test_worker_threads_leave_one_core(monkeypatch, cores, threads):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    assert stack.one_host_worker_threads() == threads
