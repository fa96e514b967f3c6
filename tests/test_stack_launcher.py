"""The one-host launcher (`python -m tokenwire.stack`, no model): it leaves a core to the gateway and
detok workers on hosts of 8 cores or more and splits the rest between the model worker replicas;
its services end with it however it ends; it refuses a port another server holds before loading
anything."""

from __future__ import annotations

import os
import signal
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


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "99999"], "--port must be in 0..65535"),
    (["--port", "-1"], "--port must be at least 0"),
    (["--num-detok", "0"], "--num-detok must be at least 1"),
    (["--num-model-workers", "0"], "--num-model-workers must be at least 1"),
    # Flags the stack sets itself: a user's copy won, and the stack waited 300 s for a service elsewhere.
    (["--gateway-arg=--port=18931"], "--port as --gateway-arg: the stack sets it"),
    (["--", "--port", "5"], "--port as a model worker flag"),
    (["--", "--tls-cert-file", "c.pem"], "--tls-cert-file: the stack runs its services on loopback in plaintext"),
])
def test_the_launcher_refuses_bad_counts_and_ports_in_one_line(args: list[str], message: str) -> None:
    # Each was a traceback (OverflowError, ZeroDivisionError), some after a whole model load.
    done = subprocess.run([sys.executable, "-m", "tokenwire.stack", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_abbreviated_flags_and_tls_variables_do_not_get_past_the_stack(tmp_path) -> None:
    # "--hos 0.0.0.0" reached the model worker's --host (its gRPC has no API keys); a TLS file
    # named in the environment made the stack's plaintext probes wait 300 s.
    done = subprocess.run([sys.executable, "-m", "model_worker", "--hos", "0.0.0.0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "unrecognized arguments: --hos" in done.stderr
    done = subprocess.run([sys.executable, "-m", "tokenwire.stack"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TOKENWIRE_DETOK_TLS_CERT_FILE": "c.pem"})
    assert done.returncode == 2 and "TOKENWIRE_DETOK_TLS_CERT_FILE: the stack runs its services" in done.stderr


def test_a_service_that_fails_to_start_ends_the_launcher_in_one_line(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "tokenwire.stack", "--port", str(stack.free_port()), "--",
                           "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "ERROR model_worker: cannot start: --model" in done.stderr  # the worker's own line
    assert "tokenwire.stack: model_worker exited with code 1" in done.stderr
    assert "Traceback" not in done.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


# A gRPC health server that starts listening only after a delay, as a model worker loading its weights.
LATE_HEALTH_SERVER = """
import asyncio, sys, time
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tokenwire import grpc_server

async def main(port, delay_s):
    await asyncio.sleep(delay_s)
    server = grpc_server.new_server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(time.time(), flush=True)
    await asyncio.sleep(60)

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""


def test_the_start_probe_sees_a_late_worker_soon_after_it_serves() -> None:
    # One channel kept across the refused connections waited out gRPC's reconnect backoff: a worker
    # that listened after 6 s was seen at 15 s (at 10 s with 0.1-0.5 s backoff options).
    port = stack.free_port()
    worker = subprocess.Popen([sys.executable, "-c", LATE_HEALTH_SERVER, str(port), "6"],
                              stdout=subprocess.PIPE, text=True)
    service = stack.ServiceProcess("late worker", [], worker, {})
    try:
        stack.wait_grpc_serving(service, f"127.0.0.1:{port}", timeout_s=60)
        seen = time.time()
        serving_since = float(worker.stdout.readline())
        assert seen - serving_since < 2.0, f"seen {seen - serving_since:.2f} s after it served"
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.parametrize("host, shown", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "[::1]"),
                                         ("::1", "[::1]"), ("10.1.2.3", "10.1.2.3"), ("gw.internal", "gw.internal")])
def test_the_gateway_url_names_an_address_a_client_can_reach(host, shown) -> None:
    assert stack.url_host(host) == shown


def test_the_launcher_restarts_a_worker_that_exits_and_stops_when_the_gateway_does(capsys) -> None:
    # A replica's crash (an OOM kill) took the whole stack down, the healthy replicas and the gateway
    # with it; now only the gateway's exit, or a worker that keeps exiting, ends it.
    def service(name: str, code: int) -> stack.ServiceProcess:
        argv = [sys.executable, "-c", f"import sys, time; time.sleep(0.2); sys.exit({code})"]
        return stack.ServiceProcess(name, argv, subprocess.Popen(argv))

    crashing = service("model_worker", 9)
    steady = stack.ServiceProcess("detok_worker", [], subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        assert stack.supervise([crashing, steady], lambda: False, poll_s=0.05, max_restarts=2) == 1
        assert crashing.process.returncode == 9 and steady.process.poll() is None  # started 3 times in all
        said = capsys.readouterr().err.splitlines()
        assert said == ["model_worker exited with code 9; starting it again (1 of 2)",
                        "model_worker exited with code 9; starting it again (2 of 2)",
                        "model_worker exited with code 9 (restarted 2 times); stopping"]
        gateway = service("gateway", 0)
        assert stack.supervise([gateway, steady], lambda: False, poll_s=0.05) == 1
        assert capsys.readouterr().err == "gateway exited with code 0; stopping\n"
        calls = iter([False, False, True])
        assert stack.supervise([steady], lambda: next(calls), poll_s=0.05) == 0
    finally:
        steady.kill()


FAST = stack.Liveness(period_s=0.1, timeout_s=0.3, failures=3)


def test_a_service_that_stops_answering_its_health_check_is_killed_and_started_again(capsys) -> None:
    # A worker whose event loop hangs keeps its socket and answers nothing: Kubernetes' liveness
    # probe kills such a pod, the launcher only restarted a service that exited. SIGSTOP stands in
    # for the hang; a real detok worker, probed over grpc.health.v1 as the stack probes it.
    port = stack.free_port()
    argv = [sys.executable, "-m", "detok_worker", "--host", "127.0.0.1", "--port", str(port)]
    address = f"127.0.0.1:{port}"
    worker = stack.ServiceProcess("detok_worker", argv, subprocess.Popen(argv), answers=stack.grpc_health_answers(address))
    try:
        stack.wait_grpc_serving(worker, address, 60)
        first = worker.process
        stopped_at = [0.0]

        def stopping() -> bool:
            if not stopped_at[0] and time.monotonic() > started + 1:  # answered meanwhile: now it hangs
                first.send_signal(signal.SIGSTOP)
                stopped_at[0] = time.monotonic()
            return worker.process is not first and worker.answers(1.0)  # started again, and answering

        started = time.monotonic()
        assert stack.supervise([worker], stopping, poll_s=0.05, liveness=FAST) == 0
        assert first.wait(5) == -signal.SIGKILL
        killed_after = time.monotonic() - stopped_at[0]
        said = capsys.readouterr().err.splitlines()
        assert said[0].startswith("detok_worker did not answer its health check 3 times in a row"), said
        assert said[1] == "detok_worker exited with code -9; starting it again (1 of 3)", said
        assert killed_after < 10, killed_after
    finally:
        worker.kill()


def test_a_service_not_answering_yet_is_not_taken_as_hung() -> None:
    # Probed once it has answered since its (re)start: a model worker loading its weights for minutes
    # answers nothing, and must not be killed for it.
    loading = stack.ServiceProcess("model_worker", [], subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
                                   answers=lambda _timeout: False)
    try:
        until = time.monotonic() + 1.0
        assert stack.supervise([loading], lambda: time.monotonic() > until, poll_s=0.02, liveness=FAST) == 0
        assert loading.process.poll() is None
    finally:
        loading.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_signal_during_start_up_ends_the_launcher_at_once(tiny_model_dir) -> None:
    # The waits for each service to start never looked at the signal: the launcher went on starting
    # the stack (and a gateway whose workers had gone waited for them up to --startup-timeout-s).
    port = stack.free_port()
    launcher = subprocess.Popen([sys.executable, "-m", "tokenwire.stack", "--port", str(port), "--",
                                 "--model", str(tiny_model_dir), "--load-format", "dummy", "--device", "cpu",
                                 "--max-model-len", "128"], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the workers are loading
        began = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) == 128 + signal.SIGTERM  # as a shell reports SIGTERM (130 is SIGINT's)
        assert time.monotonic() - began < 12  # each service gets STARTING_STOP_S, not a drain's 40 s
        assert "stopped during start-up" in launcher.stderr.read()
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize(("args", "env", "grace"), [
    ([], None, 30.0),
    (["--drain-grace-s", "120"], None, 120.0),
    (["--drain-grace-s=5", "--port", "1"], None, 5.0),
    (["--drain-grace-s", "5", "--drain-grace-s=7"], None, 7.0),  # the last, as argparse takes it
    ([], {"TOKENWIRE_GATEWAY_DRAIN_GRACE_S": "90"}, 90.0),
    # Another service's variable is not the gateway's (the first found was taken: 5 s, review 95).
    ([], {"TOKENWIRE_MODEL_WORKER_DRAIN_GRACE_S": "5", "TOKENWIRE_GATEWAY_DRAIN_GRACE_S": "120"}, 120.0),
    ([], {"TOKENWIRE_DETOK_DRAIN_GRACE_S": "5"}, 30.0),
    (["--drain-grace-s", "oops"], None, 30.0),  # the service refuses it itself
])
def test_a_service_gets_its_own_drain_grace_before_it_is_killed(args, env, grace) -> None:
    # A fixed 40 s cut a 120 s drain short: 7 of 40 requests got an empty reply.
    assert stack.drain_grace_s(args, env, service="gateway") == grace
    service = stack.ServiceProcess("gateway", [sys.executable, "-m", "gateway", *args],
                                   subprocess.Popen([sys.executable, "-c", "pass"]), env)
    service.process.wait()
    assert service.stop_timeout_s == grace + stack.STOP_SLACK_S


def test_stopping_says_whether_a_service_had_to_be_killed(capsys) -> None:
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE,
                                text=True)
    assert stubborn.stdout.readline() == "ready\n"
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    services = [stack.ServiceProcess("model_worker", [], polite), stack.ServiceProcess("gateway", [], stubborn)]
    whole = stack.Stack([], [], "", services)
    assert whole.stop(0.5) is True and stubborn.returncode == -signal.SIGKILL and polite.returncode == -signal.SIGTERM
    assert "gateway did not exit within its drain; killing it" in capsys.readouterr().err
    assert stack.Stack([], [], "", [stack.ServiceProcess("x", [], polite)]).stop(0.5) is False  # already gone
