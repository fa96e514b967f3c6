"""The one-host launcher leaves a core to the gateway and detok workers on hosts of 8 cores or
more, and splits the rest between the model worker replicas."""

from __future__ import annotations

import pytest

from tokenwire import stack


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (4, 4), (8, 7), (16, 15), (None, 1)])
def test_worker_threads_leave_one_core_on_larger_hosts(monkeypatch, cores, threads):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    assert stack.one_host_worker_threads() == threads


@pytest.mark.parametrize("cores, workers, threads", [(2, 2, 1), (16, 2, 7), (16, 3, 5), (4, 8, 1), (4, 2, 2)])
def test_model_worker_replicas_share_the_remaining_cores(monkeypatch, cores, workers, threads):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    assert stack.one_host_worker_threads(workers) == threads
