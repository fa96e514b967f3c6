"""The gateway process before it serves: it waits for its workers, and a signal or its start-up
time-out ends that wait with a plain reason."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from gateway.__main__ import STARTUP_FAILURE
from tokenwire.stack import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def start_gateway(*flags: str, log: Path) -> subprocess.Popen:
    """A gateway whose workers (free ports, nothing listening) never answer."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "--port", str(free_port()),
             "--model-workers", f"127.0.0.1:{free_port()}", "--detok-workers", f"127.0.0.1:{free_port()}", *flags],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)


def run_to_its_end(*flags: str, log: Path) -> tuple[int, str]:
    """A gateway that ends by itself: its exit status and its log."""
    gateway = start_gateway(*flags, log=log)
    try:
        code = gateway.wait(30)
    finally:
        gateway.kill()
        gateway.wait()
    return code, log.read_text()


def wait_for_line(log: Path, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_sigterm_while_waiting_for_the_workers_stops_the_gateway_at_once(tmp_path: Path) -> None:
    """uvicorn holds signals until the app's lifespan has started, and the lifespan waited for the
    workers: a SIGTERM then (compose down, a rollout) went unanswered for up to --startup-timeout-s."""
    log = tmp_path / "gateway.log"
    gateway = start_gateway(log=log)
    try:
        wait_for_line(log, "waiting for the workers")  # logged once its signal handlers are in place
        signalled = time.monotonic()
        gateway.send_signal(signal.SIGTERM)
        code = gateway.wait(10)
        stopped_s = time.monotonic() - signalled
    finally:
        gateway.kill()
        gateway.wait()
    assert code == 128 + signal.SIGTERM, log.read_text()
    assert "SIGTERM while waiting for the workers: stopped" in log.read_text()
    assert stopped_s < 5, stopped_s
    print(f"\n[figure] gateway SIGTERM while waiting for its workers: exited {stopped_s:.2f}s later")


def test_workers_that_never_answer_end_the_start_with_their_status_in_one_line(tmp_path: Path) -> None:
    code, text = run_to_its_end("--startup-timeout-s", "1", log=tmp_path / "gateway.log")
    assert code == STARTUP_FAILURE, text
    [line] = [line for line in text.splitlines() if "not serving" in line]
    assert "no model worker answered GetModelInfo before --startup-timeout-s" in line, text
    assert line.endswith("DEADLINE_EXCEEDED: Deadline Exceeded"), line
    assert "debug_error_string" not in text and "Traceback" not in text, text


def test_a_tls_file_that_is_missing_fails_the_start_at_once_not_after_the_wait(tmp_path: Path) -> None:
    started = time.monotonic()
    code, text = run_to_its_end("--tls-cert-file", str(tmp_path / "missing.pem"), "--tls-key-file",
                                str(tmp_path / "missing.key"), log=tmp_path / "gateway.log")
    assert code == 1 and "not serving: --tls-cert-file" in text and "missing.pem" in text, text
    assert "waiting for the workers" not in text and "Traceback" not in text, text
    assert time.monotonic() - started < 20
