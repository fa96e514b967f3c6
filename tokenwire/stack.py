"""Starts the three services as separate processes and waits until each answers its health check.

`make serve` runs `python -m tokenwire.stack`; the end-to-end tests use start_stack() so they
exercise exactly the processes a user runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenwire.grpc_server import DEFAULT_GRACE_S
from tokenwire.grpc_tls import ClientTLS, check_bindable, sync_channel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceFailedToStart(RuntimeError):
    pass


# How long a service gets to exit before SIGKILL: a running one drains (its --drain-grace-s, 30 s
# by default) and gets this much more; one stopped during the stack's start-up serves nothing yet.
STOP_SLACK_S = 10.0
STARTING_STOP_S = 5.0


# Each service's environment prefix: its __main__ parses its flags with it, and the stack reads
# a service's drain grace with it.
ENV_PREFIXES = {"model_worker": "TOKENWIRE_MODEL_WORKER_", "detok_worker": "TOKENWIRE_DETOK_",
                "gateway": "TOKENWIRE_GATEWAY_"}


def drain_grace_s(args: Sequence[str], env: dict[str, str] | None = None, default: float = DEFAULT_GRACE_S,
                  service: str = "gateway") -> float:
    """The --drain-grace-s a service runs with: its flag (last one wins, as argparse takes it),
    else its own <prefix>DRAIN_GRACE_S variable (another service's is not its), else the default."""
    grace: str | None = None
    for i, arg in enumerate(args):
        if arg == "--drain-grace-s" and i + 1 < len(args):
            grace = args[i + 1]
        elif arg.startswith("--drain-grace-s="):
            grace = arg.partition("=")[2]
    if grace is None:
        grace = (env or {}).get(f"{ENV_PREFIXES.get(service, 'TOKENWIRE_')}DRAIN_GRACE_S")
    try:
        return float(grace) if grace is not None else default
    except ValueError:
        return default  # the service refuses it itself


@dataclass
class ServiceProcess:
    name: str
    args: list[str]
    process: subprocess.Popen
    process_env: dict[str, str] | None = None
    # Whether it answers its health check within the timeout (s) given: supervise's liveness probe.
    answers: Callable[[float], bool] | None = None

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise ServiceFailedToStart(f"{self.name} exited with code {self.process.returncode}: {' '.join(self.args)}")

    @property
    def stop_timeout_s(self) -> float:
        """Its drain's grace and STOP_SLACK_S: a 120 s grace was cut at 40 s (7 of 40 requests
        got an empty reply, and the stack still exited 0)."""
        return drain_grace_s(self.args, self.process_env, service=self.name) + STOP_SLACK_S

    def stop(self, timeout_s: float | None = None) -> bool:
        """SIGTERM (the service drains), then SIGKILL if it has not exited within timeout_s (its
        own stop_timeout_s by default). Returns whether it had to be killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not exit within its drain; killing it", file=sys.stderr, flush=True)
                self.process.kill()
                self.process.wait()
                return True
        return False

    def kill(self) -> None:
        """SIGKILL, no drain: what a crash or an OOM kill looks like to the other services."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def respawn(self) -> None:
        """Starts the same command again (same flags, same port) after it exited."""
        if self.process.poll() is None:
            raise RuntimeError(f"{self.name} is still running")
        self.process = subprocess.Popen(self.args, env=self.process_env)


# Set by `python -m tokenwire.stack` for its services: each exits when that launcher does, however
# it ends (a SIGKILL left them serving, holding the port and the model's memory).
PARENT_PID_ENV = "TOKENWIRE_STACK_PID"


def spawn(name: str, module: str, args: Sequence[str], env: dict[str, str] | None = None,
          answers: Callable[[float], bool] | None = None) -> ServiceProcess:
    argv = [sys.executable, "-m", module, *args]
    full_env = {**os.environ, **(env or {})}
    return ServiceProcess(name, argv, subprocess.Popen(argv, env=full_env), full_env, answers)


def exit_with_the_stack() -> None:
    """In a service: when PARENT_PID_ENV names the launcher, get SIGTERM (the usual drain) when it
    dies (Linux's PR_SET_PDEATHSIG), or exit now if it already has. A no-op elsewhere."""
    launcher = os.environ.get(PARENT_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(launcher):  # it died before the prctl: nobody would signal us
        raise SystemExit("the tokenwire.stack launcher that started this service has exited")


def wait_grpc_serving(service: ServiceProcess, address: str, timeout_s: float,
                      tls: ClientTLS | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        service.check_alive()
        # A new channel each try: one channel kept across refused connections waits out gRPC's
        # reconnect backoff (1 s, x1.6 per failure; shorter backoff options did not hold on the
        # poll-based socket layer, see tokenwire/grpc_io.py), so a worker that took 15 s to load was
        # first seen serving ~10 s after it listened, and the gateway started that much later.
        try:
            if health_check(address, tls, 2).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise ServiceFailedToStart(f"{service.name} not serving on {address} after {timeout_s:.0f}s")
        time.sleep(0.2)


def health_check(address: str, tls: ClientTLS | None, timeout_s: float) -> health_pb2.HealthCheckResponse:
    """One grpc.health.v1 Check of the whole server, on a channel of its own; raises grpc.RpcError."""
    with sync_channel(address, tls) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)


def grpc_health_answers(address: str, tls: ClientTLS | None = None) -> Callable[[float], bool]:
    """A worker's liveness check: its grpc.health.v1 answers (any answer: NOT_SERVING while it drains
    is no hang for a supervisor to kill)."""
    def answers(timeout_s: float) -> bool:
        try:
            health_check(address, tls, timeout_s)
        except grpc.RpcError as exc:
            return exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        return True
    return answers


def http_health_answers(url: str) -> Callable[[float], bool]:
    """The gateway's liveness check: its /health answers (any HTTP status: it is not hung)."""
    def answers(timeout_s: float) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
    return answers


def wait_http_ok(service: ServiceProcess, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        service.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServiceFailedToStart(f"{service.name} not answering {url} after {timeout_s:.0f}s")
        time.sleep(0.2)


@dataclass
class Stack:
    model_worker_addresses: list[str]
    detok_addresses: list[str]
    gateway_url: str
    services: list[ServiceProcess] = field(default_factory=list)
    killed: bool = False  # a service had to be killed when the stack stopped

    @property
    def model_worker_address(self) -> str:
        """The first model worker's address: the only one in a stack started with one."""
        return self.model_worker_addresses[0]

    def stop(self, timeout_s: float | None = None) -> bool:
        """Each service in turn, the gateway first (its open requests end before the workers
        go); timeout_s None: each its own drain's. Returns whether any had to be killed."""
        killed = False
        for service in reversed(self.services):
            killed |= service.stop(timeout_s)
        return killed


def url_host(host: str) -> str:
    """How a URL on this host names the gateway bound to `host`: a wildcard bind is reached on
    loopback (a banner saying http://0.0.0.0:8000 is no address to browse to), an IPv6 one in brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@contextlib.contextmanager
def start_stack(model_worker_args: Sequence[str] = (), num_detok: int = 1, host: str = "127.0.0.1",
                gateway_port: int | None = None, gateway_args: Sequence[str] = (),
                timeout_s: float = 300.0, detok_args: Sequence[str] = (),
                tls: ClientTLS | None = None, num_model_workers: int = 1,
                model_worker_module: str = "model_worker", exit_with_launcher: bool = False) -> Iterator[Stack]:
    """num_model_workers model worker replicas (same args), num_detok detok replicas and the
    gateway, on free loopback ports. model_worker_module: what runs as the model worker
    (bench/serving_path.py puts a stand-in with no model there). exit_with_launcher: the services
    exit when this process does, however it ends (for `python -m tokenwire.stack`, whose main
    thread started them: Linux ties the signal to the thread that forked).

    With TLS, the worker args carry the --tls-* flags and gateway_args the --worker-tls-* ones;
    `tls` is what the launcher's own health probes use to reach the workers.
    """
    # The workers' gRPC has no API keys: they listen on loopback only, whatever `host` opens the
    # gateway to (as compose.yaml publishes them).
    worker_host = "127.0.0.1"
    mw_addrs = [f"{worker_host}:{free_port()}" for _ in range(num_model_workers)]
    detok_addrs = [f"{worker_host}:{free_port()}" for _ in range(num_detok)]
    port = gateway_port or free_port()
    stack = Stack(mw_addrs, detok_addrs, f"http://{url_host(host)}:{port}")
    started = False
    env = {PARENT_PID_ENV: str(os.getpid())} if exit_with_launcher else None
    try:
        mws = []
        for addr in mw_addrs:
            mws.append(spawn("model_worker", model_worker_module,
                             ["--host", worker_host, "--port", addr.rsplit(":", 1)[1], *model_worker_args], env,
                             grpc_health_answers(addr, tls)))
            stack.services.append(mws[-1])
        detoks = []
        for addr in detok_addrs:
            detoks.append(spawn("detok_worker", "detok_worker",
                                ["--host", worker_host, "--port", addr.rsplit(":", 1)[1], *detok_args], env,
                                grpc_health_answers(addr, tls)))
            stack.services.append(detoks[-1])
        for d, addr in zip(detoks, detok_addrs, strict=True):
            wait_grpc_serving(d, addr, timeout_s, tls)
        for mw, addr in zip(mws, mw_addrs, strict=True):
            wait_grpc_serving(mw, addr, timeout_s, tls)
        gw = spawn("gateway", "gateway", ["--host", host, "--port", str(port), "--model-workers", ",".join(mw_addrs),
                                          "--detok-workers", ",".join(detok_addrs), *gateway_args], env,
                   http_health_answers(f"{stack.gateway_url}/health"))
        stack.services.append(gw)
        wait_http_ok(gw, f"{stack.gateway_url}/health", timeout_s)
        started = True
        yield stack
    finally:
        # Stopped during start-up: nothing serves yet, so each service gets STARTING_STOP_S before
        # SIGKILL, not a drain's grace (a gateway waiting for its workers exits on SIGTERM at once).
        stack.killed = stack.stop(None if started else STARTING_STOP_S)


RESERVE_CORE_FROM = 8


def one_host_worker_threads(num_model_workers: int = 1) -> int:
    """Torch threads for each model worker sharing its host with the gateway and detok workers,
    the cores split between the model workers. From RESERVE_CORE_FROM cores on, one core is left
    to the serving path, which needs ~0.15 of a core at 32 streams on SmolLM2; below that a whole
    core is too much compute to give up: on 2 cores, 2 worker threads served 607-645 tok/s at 32
    streams through the gateway against 380-416 with 1 (and 66 vs ~60 at one stream)."""
    cores = os.cpu_count() or 1
    if cores >= RESERVE_CORE_FROM:
        cores -= 1
    return max(1, cores // num_model_workers)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenwire.stack",
                                     description="Start model worker, detok worker(s) and gateway.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the gateway's address (the workers stay on loopback: their gRPC has no API keys)")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    parser.add_argument("--num-detok", type=int, default=1, help="detok worker replicas")
    parser.add_argument("--num-model-workers", type=int, default=1,
                        help="model worker replicas (same flags); the gateway balances requests over them")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help="a flag for the gateway, repeatable (e.g. --gateway-arg=--tool-call-parser=hermes)")
    parser.add_argument("model_worker_args", nargs=argparse.REMAINDER,
                        help="after --, flags for the model worker (e.g. -- --model /path/to/model.gguf)")
    args = parser.parse_args()
    for flag, value, least in (("--num-detok", args.num_detok, 1), ("--num-model-workers", args.num_model_workers, 1),
                               ("--port", args.port, 0)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, not {value}")
    if args.port > 65535:
        parser.error(f"--port must be in 0..65535, not {args.port}")
    extra = [a for a in args.model_worker_args if a != "--"]
    # The stack wires these itself (ports it picked, loopback workers, plaintext probes): a user's
    # copy took effect after its own, and the stack then waited 300 s for a service elsewhere.
    for given, owned, where in ((extra, ("--host", "--port"), "a model worker flag"),
                                (args.gateway_arg, ("--host", "--port", "--model-workers", "--detok-workers"),
                                 "--gateway-arg")):
        for arg in given:
            name = arg.partition("=")[0]
            if name in owned:
                parser.error(f"{name} as {where}: the stack sets it (its own --host/--port for the gateway)")
            if name.startswith(("--tls-", "--worker-tls-")):
                parser.error(f"{name}: the stack runs its services on loopback in plaintext and probes them so; "
                             "for TLS (between them, or HTTPS on the gateway) start each service itself "
                             "(deploy/README.md)")
    # The services read their flags from the environment too: the stack's own flags win over
    # addresses there, but nothing of its overrides a TLS file named there.
    for variable in os.environ:
        if any(variable.startswith((f"{prefix}TLS_", f"{prefix}WORKER_TLS_")) for prefix in ENV_PREFIXES.values()):
            parser.error(f"{variable}: the stack runs its services on loopback in plaintext and probes them so; "
                         "unset it, or start each service itself for TLS (deploy/README.md)")
    if not any(a.startswith("--num-threads") for a in extra):
        extra += ["--num-threads", str(one_host_worker_threads(args.num_model_workers))]
    stopping = False
    up = False

    stopped_by = signal.SIGINT

    def on_signal(signum, frame):
        nonlocal stopping, stopped_by
        stopping, stopped_by = True, signum
        if not up:  # a wait for a service to start would not look at `stopping`: end it here
            raise ServiceFailedToStart("stopped during start-up")

    try:  # before loading a model, not after: another server on the port would answer our /health
        check_bindable(args.host, args.port)
    except OSError as exc:
        in_use = isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EADDRINUSE
        print(f"{exc}{' (another server there? PORT=... picks another)' if in_use else ''}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        def now_up() -> None:
            nonlocal up
            up = True

        return _serve(args, extra, lambda: stopping, now_up)
    except ServiceFailedToStart as exc:
        if not stopping:  # its own log, above, says why
            print(f"tokenwire.stack: {exc}", file=sys.stderr)
            return 1
        print("stopped during start-up", file=sys.stderr)  # Ctrl-C reached the services too
        return 128 + stopped_by  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them


def _serve(args: argparse.Namespace, model_worker_args: list[str], stopping: Callable[[], bool],
           now_up: Callable[[], None]) -> int:
    code = 0
    with start_stack(model_worker_args, args.num_detok, args.host, args.port, gateway_args=args.gateway_arg,
                     num_model_workers=args.num_model_workers, exit_with_launcher=True) as stack:
        now_up()
        if not stopping():  # else a signal came as the last service started
            listening = f" (listening on {args.host})" if url_host(args.host) != args.host else ""
            print(f"tokenwire is up: OpenAI API at {stack.gateway_url}/v1{listening} (model workers "
                  f"{','.join(stack.model_worker_addresses)}, detok {','.join(stack.detok_addresses)})", flush=True)
            code = supervise(stack.services, stopping)
    return 1 if stack.killed else code  # a drain cut short lost requests: not a clean stop


# Times the launcher starts one worker again after it exited (a crash, an OOM kill) before it gives up.
MAX_WORKER_RESTARTS = 3


@dataclass(frozen=True)
class Liveness:
    """How supervise probes each service, as deploy/k8s's livenessProbes do: a service whose event
    loop hangs keeps its socket and answers nothing, and only a kill ends it (Kubernetes kills such a
    pod; the launcher restarted only a service that exited). Probed once it has answered since its
    (re)start: a model still loading is not hung."""

    period_s: float = 10.0
    timeout_s: float = 5.0
    failures: int = 3


@dataclass
class _Probe:
    process: subprocess.Popen  # the process it probes: a respawn starts over
    answered: bool = False
    misses: int = 0
    next_at: float = 0.0
    pending: concurrent.futures.Future[bool] | None = None


def supervise(services: Sequence[ServiceProcess], stopping: Callable[[], bool], poll_s: float = 0.5,
              max_restarts: int = MAX_WORKER_RESTARTS, liveness: Liveness = Liveness()) -> int:
    """Until stopping(): a worker that exits is started again, on its port with its flags (the
    gateway reconnects to it; its requests in flight fail, those on other replicas go on), up to
    max_restarts times each; the gateway exiting, or a worker past that, ends the stack (1). A
    service that stops answering its liveness check (Liveness) is killed, and so handled the same."""
    restarts = dict.fromkeys(range(len(services)), 0)
    probes: dict[int, _Probe] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max(1, len(services)), thread_name_prefix="liveness")
    try:
        while not stopping():
            for number, service in enumerate(services):
                if service.process.poll() is None:
                    _probe_liveness(number, service, liveness, probes, pool)
                    continue
                code = service.process.returncode
                if service.name == "gateway" or restarts[number] >= max_restarts:
                    again = "" if service.name == "gateway" else f" (restarted {restarts[number]} times)"
                    print(f"{service.name} exited with code {code}{again}; stopping", file=sys.stderr, flush=True)
                    return 1
                restarts[number] += 1
                print(f"{service.name} exited with code {code}; starting it again ({restarts[number]} of "
                      f"{max_restarts})", file=sys.stderr, flush=True)
                service.respawn()
            time.sleep(poll_s)
        return 0
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a check in flight must not hold the stop


def _probe_liveness(number: int, service: ServiceProcess, liveness: Liveness, probes: dict[int, _Probe],
                    pool: concurrent.futures.Executor) -> None:
    """One look at a running service's liveness probe: its last check's answer, and the next check
    when due; kills it past liveness.failures misses in a row."""
    if service.answers is None:
        return
    probe = probes.get(number)
    if probe is None or probe.process is not service.process:
        probe = probes[number] = _Probe(service.process)
    if probe.pending is not None and probe.pending.done():
        answered = probe.pending.exception() is None and probe.pending.result()  # (cancelled only once it stops)
        probe.pending = None
        if answered:
            probe.answered, probe.misses = True, 0
        elif probe.answered:
            probe.misses += 1
            if probe.misses >= liveness.failures:
                print(f"{service.name} did not answer its health check {probe.misses} times in a row "
                      f"({liveness.timeout_s:g} s each, every {liveness.period_s:g} s): taken as hung, killing it",
                      file=sys.stderr, flush=True)
                service.process.kill()
                return
    now = time.monotonic()
    if probe.pending is None and now >= probe.next_at:
        probe.pending = pool.submit(service.answers, liveness.timeout_s)
        probe.next_at = now + liveness.period_s


if __name__ == "__main__":
    raise SystemExit(main())
