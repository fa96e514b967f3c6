"""--sched-slice-us: the serving threads' CPU time slice (tokenwire/sched_slice.py).

The kernel checks need Linux 6.12+ (custom EEVDF slices); they skip elsewhere, where the request
is a no-op by design.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from detok_worker.config import Config as DetokConfig
from gateway.config import Config as GatewayConfig
from model_worker.config import Config as ModelWorkerConfig
from model_worker.engine_loop import ENGINE_THREAD_NAME
from tests.conftest import tiny_model_worker
from tokenwire import sched_slice
from tokenwire.config_cli import parse_config
from tokenwire.sched_slice import request_thread_slice, thread_slice_ns

REPO = Path(__file__).resolve().parent.parent


def in_new_thread(fn):
    """fn's result, run on a fresh thread (so the test process's own threads keep their slice)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn()))
    thread.start()
    thread.join()
    return out["result"]


def custom_slices_work() -> bool:
    return in_new_thread(lambda: request_thread_slice(300) and thread_slice_ns() == 300_000)


needs_custom_slices = pytest.mark.skipif(not custom_slices_work(),
                                         reason="this kernel does not take custom time slices (Linux 6.12+)")


@pytest.mark.parametrize("config", [GatewayConfig, DetokConfig, ModelWorkerConfig])
def test_every_service_takes_the_flag_and_checks_its_range(config):
    assert parse_config(config, []).sched_slice_us == 100
    assert parse_config(config, ["--sched-slice-us", "0"]).sched_slice_us == 0
    assert parse_config(config, ["--sched-slice-us", "100000"]).sched_slice_us == 100_000
    for bad in ("99", "100001", "-1"):
        with pytest.raises(SystemExit):
            parse_config(config, ["--sched-slice-us", bad])


def test_not_linux_is_a_no_op(monkeypatch):
    monkeypatch.setattr(sched_slice.sys, "platform", "darwin")
    assert request_thread_slice(200) is False
    assert thread_slice_ns() is None


@needs_custom_slices
def test_a_thread_asks_for_a_slice_and_the_threads_it_starts_inherit_it():
    def run():
        default = thread_slice_ns()
        assert request_thread_slice(250)
        mine = thread_slice_ns()
        child = in_new_thread(thread_slice_ns)
        assert request_thread_slice(0)
        return default, mine, child, thread_slice_ns()

    default, mine, child, restored = in_new_thread(run)
    assert (mine, child) == (250_000, 250_000)
    assert restored == default != 250_000


@needs_custom_slices
@pytest.mark.parametrize("whole_process", [True, False])
def test_whole_process_also_covers_threads_started_before(whole_process):
    # In a child process: it changes the slices of every thread it has.
    script = f"""
import threading, time
from tokenwire.sched_slice import SchedSliceOption, thread_slice_ns, use_serving_slice
ready, done, ids = threading.Event(), threading.Event(), []
def earlier():
    ids.append(threading.get_native_id()); ready.set(); done.wait()
t = threading.Thread(target=earlier); t.start(); ready.wait()
before = thread_slice_ns(ids[0])
use_serving_slice(SchedSliceOption(sched_slice_us=400), "test", whole_process={whole_process})
print(before, thread_slice_ns(), thread_slice_ns(ids[0]))
done.set(); t.join()
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    before, caller, earlier = map(int, out.stdout.split())
    assert caller == 400_000
    assert earlier == (400_000 if whole_process else before)


@needs_custom_slices
def test_model_worker_engine_threads_keep_the_default_slice(tiny_model_dir):
    with tiny_model_worker(tiny_model_dir, "--sched-slice-us", "500") as address:
        del address
        [worker] = [p for p in _children() if "model_worker" in _cmdline(p)]
        threads = {int(t): Path(f"/proc/{worker}/task/{t}/comm").read_text().strip()
                   for t in os.listdir(f"/proc/{worker}/task")}
        slices = {t: thread_slice_ns(t) for t in threads}
    engine = [t for t, name in threads.items() if name == ENGINE_THREAD_NAME]
    assert engine, threads
    assert all(slices[t] != 500_000 for t in engine), (threads, slices)
    assert slices[worker] == 500_000  # the event loop's thread
    # gRPC's threads start after the engine is built: they serve, and inherit the short slice.
    assert any(slices[t] == 500_000 for t, name in threads.items() if t != worker and name != ENGINE_THREAD_NAME)


def _children() -> list[int]:
    return [int(p) for p in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
