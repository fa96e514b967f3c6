"""The one-host launcher (`python -m tokenwire.stack`, no model): it leaves a core to the gateway and
detok workers on hosts of 8 cores or more and splits the rest between the model worker replicas;
its services end with it however it ends; it refuses a port another server holds before loading
anything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tokenwire import stack
from tokenwire.stack import PARENT_PID_ENV


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 2), (4, 4), (8, 7), (16, 15), (None, 1)])
def test_worker_threads_leave_one_core_on_larger_hosts(monkeypatch, cores, threads):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    assert stack.one_host_worker_threads() == threads


@pytest.mark.parametrize("cores, workers, threads", [(2, 2, 1), (16, 2, 7), (16, 3, 5), (4, 8, 1), (4, 2, 2)])
def test_model_worker_replicas_share_the_remaining_cores(monkeypatch, cores, workers, threads):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    assert stack.one_host_worker_threads(workers) == threads


SERVICE = "from tokenwire.stack import exit_with_the_stack; exit_with_the_stack(); print('serving', flush=True); " \
          "import time; time.sleep(60)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_service_ends_when_its_launcher_is_killed() -> None:
    # The launcher here: a process that starts a "service" with the variable naming it, then is killed.
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time; "
        f"child = subprocess.Popen([sys.executable, '-c', {SERVICE!r}], env={{**os.environ, "
        f"'{PARENT_PID_ENV}': str(os.getpid())}}); print(child.pid, flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    service_pid = int(launcher.stdout.readline())
    time.sleep(1.0)  # the service has set its death signal
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(service_pid):
        time.sleep(0.1)
    assert not _alive(service_pid)


def test_a_service_whose_launcher_is_already_gone_exits() -> None:
    done = subprocess.run([sys.executable, "-c", SERVICE], env={**os.environ, PARENT_PID_ENV: "1"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "launcher that started this service has exited" in done.stderr
    assert "serving" not in done.stdout


def test_the_launcher_refuses_a_port_in_use_before_starting_anything() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "tokenwire.stack", "--port", str(port)], capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 1 and f"cannot serve on 127.0.0.1:{port}" in done.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"
