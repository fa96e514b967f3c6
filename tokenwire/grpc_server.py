"""gRPC server plumbing shared by both workers: health service, reflection, options, drain.

Each worker's __main__ builds its servicer, then calls serve_until_signal, so both workers
answer grpc.health.v1 and server reflection (grpcurl works against either), bind with TLS when
configured (grpc_tls), and drain the same way on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenwire.grpc_tls import ServerTLS, add_port, check_bindable

logger = logging.getLogger(__name__)

# Frames carry many sequences; the 4 MiB default is too small for a 256-sequence frame
# with top-20 logprobs, and prompts of a full context arrive in one AddRequest.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that stops answering (hung process, dropped network) is found within 15 s even
    # while the stream is idle; a killed one is found at once (its socket closes).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # grpc-core waits this long for any ping's ack (default 60 s, which also governed the
    # keepalive pings: a SIGSTOPped worker took 70 s to be noticed; now 5-15 s).
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Servers must accept the clients' 10 s pings on an idle stream, or they answer
    # GOAWAY "too_many_pings" after two (their default floor is 5 minutes).
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # Clients reconnect to a lost worker with gRPC's exponential backoff (x1.6, 20% jitter)
    # from 0.25 s, capped at 5 s so a restarted worker is back in use within seconds (the
    # default cap is 120 s).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    # A name with several addresses (a Kubernetes headless Service): each channel sticks to one
    # of them, picked at random, and moves to a live one when it dies. Sticking matters: a
    # client's stream, health watch and GetLoad must reach the same worker process (with
    # round_robin its health watch could report on another replica than its stream), and the
    # gateway spreads work itself, over its streams, not over the calls of one stream.
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"pick_first": {"shuffleAddressList": True}}]})),
]
DEFAULT_GRACE_S = 30.0


class MalformedStreamMessageInterceptor(grpc.aio.ServerInterceptor):
    """A stream message that does not parse ends its call with INVALID_ARGUMENT.

    grpc-python decodes streamed requests inside the servicer's `async for`, so without this a
    corrupt frame surfaces as whatever the servicer does with a DecodeError (UNKNOWN, or a
    quiet end of stream); unary requests are refused by grpc itself before the servicer runs.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler.request_streaming:
            return handler
        method = handler_call_details.method

        async def checked(request_iterator, context):
            try:
                async for request in request_iterator:
                    yield request
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed message: {exc}")

        if handler.response_streaming and inspect.isasyncgenfunction(handler.stream_stream):
            streaming = handler.stream_stream

            async def stream_stream(request_iterator, context):
                async for reply in streaming(checked(request_iterator, context), context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(stream_stream, handler.request_deserializer,
                                                         handler.response_serializer)
        if not handler.response_streaming and inspect.iscoroutinefunction(handler.stream_unary):
            unary = handler.stream_unary

            async def stream_unary(request_iterator, context):
                return await unary(checked(request_iterator, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler


# Servers only: no SO_REUSEPORT (grpc's default), so a port another worker holds is an error at
# start; with it, a second worker on the port started silently and took half the connections.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=[MalformedStreamMessageInterceptor()])


def add_health_and_reflection(
    server: grpc.aio.Server, full_service_names: Iterable[str]
) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 (every service SERVING) and reflection for the services."""
    names = list(full_service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def mark_serving(health_servicer: health.aio.HealthServicer, full_service_names: Iterable[str]) -> None:
    for name in ["", *full_service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def mark_not_serving(health_servicer: health.aio.HealthServicer, full_service_names: Iterable[str]) -> None:
    for name in ["", *full_service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


# After a drain, how long calls get to end on their own before the server cancels them.
FLUSH_S = 0.5


class StartupError(Exception):
    """A flag, file or port a worker cannot start with: one log line, no traceback."""


def check_port(host: str, port: int) -> None:
    """A worker's first check, before it loads anything: raises StartupError unless host:port can
    be bound (a port in use was found after the model's load, as a traceback)."""
    try:
        check_bindable(host, port)
    except OSError as exc:
        raise StartupError(str(exc)) from exc


def run_worker(name: str, serve: Awaitable[None]) -> None:
    """asyncio.run(serve) for a worker's main(): a StartupError is one error line and status 1,
    Ctrl-C before the server is up status 130 without a traceback (both were 20-40 lines of one)."""
    try:
        asyncio.run(serve)
    except StartupError as exc:
        logger_ = logging.getLogger(name)
        logger_.error("%s", exc)
        # What raised it, for a load that failed on a bug rather than on a flag (--log-level debug).
        logger_.debug("start-up failed at:", exc_info=exc.__cause__ or exc)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


class CallEndedWhileSendingFilter(logging.Filter):
    """grpc.aio logs an ERROR with a traceback ("ExecuteBatchError raised in core by servicer
    method") when a call ends while the server is sending it a message: its write's batch
    fails, and grpc logs that instead of raising it (grpc/grpc#32551). It happens whenever a
    client cancels a stream it has stopped reading, which is the client's doing, not a fault
    here; the record becomes one INFO line without the traceback."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.PREFIX):
            method = record.getMessage()[len(self.PREFIX):].strip()
            record.msg, record.args = "a call ended while a message was being sent to it: %s", (method,)
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info, record.exc_text = None, None
        return True


_CYGRPC_LOGGER = logging.getLogger("grpc._cython.cygrpc")


def quiet_calls_ended_while_sending() -> None:
    if not any(isinstance(f, CallEndedWhileSendingFilter) for f in _CYGRPC_LOGGER.filters):
        _CYGRPC_LOGGER.addFilter(CallEndedWhileSendingFilter())


async def serve_until_signal(server: grpc.aio.Server, address: str, grace_s: float = DEFAULT_GRACE_S,
                             tls: ServerTLS | None = None,
                             health_servicer: health.aio.HealthServicer | None = None,
                             drained: Callable[[], Awaitable[None]] | None = None) -> None:
    """Binds address (TLS when given), starts, and drains on SIGINT/SIGTERM.

    Drain: health turns NOT_SERVING (readiness probes and load balancers stop sending), new
    calls are refused, and open calls get up to grace_s; `drained` (e.g. "the engine has no
    running request") ends the wait early, since a multiplexed stream never ends on its own.
    Calls then get FLUSH_S more to end on their own (their last messages may still be on their
    way out: cancelling a call drops what it has not sent) before the rest (health watches,
    streams that stay open) is cancelled.
    """
    quiet_calls_ended_while_sending()
    try:
        add_port(server, address, tls)
    except OSError as exc:
        raise StartupError(str(exc)) from exc
    await server.start()
    logger.info("listening on %s (%s)", address, "mTLS" if tls and tls.client_ca_file else
                "TLS" if tls else "plaintext")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        started = time.monotonic()
        logger.info("draining (grace %.1fs)", grace_s)
        if health_servicer is not None:
            await health_servicer.enter_graceful_shutdown()
        stopping = asyncio.create_task(server.stop(grace_s))
        if drained is not None:
            try:
                await asyncio.wait_for(drained(), grace_s)
            except asyncio.TimeoutError:
                # `stopping` reaches the end of the same grace now and cancels what is left. No
                # second stop(0) here: two stops cancelling calls at once crashed grpc.aio
                # (SIGSEGV in Server.stop, 2 of 3 drains whose grace ran out with a call open).
                logger.warning("grace period over with work still running; cancelling it")
            else:
                logger.info("drained in %.2fs", time.monotonic() - started)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stopping), FLUSH_S)
                await server.stop(0)  # cancels what is left now instead of at the end of the grace
        await stopping
    waiter.cancel()
    stopper.cancel()


async def wait_until(predicate: Callable[[], bool], poll_s: float = 0.05) -> None:
    """Returns once predicate() is true; a `drained` hook for serve_until_signal."""
    while not predicate():
        await asyncio.sleep(poll_s)


# A drain ends once nothing has run for this long, not at the first idle instant: a gateway that
# has not yet seen NOT_SERVING may still be sending work.
DRAIN_QUIET_S = 0.25


async def wait_quiet(predicate: Callable[[], bool], quiet_s: float = DRAIN_QUIET_S) -> None:
    """Returns once predicate() has held at the start and the end of quiet_s (see DRAIN_QUIET_S)."""
    while True:
        await wait_until(predicate)
        await asyncio.sleep(quiet_s)
        if predicate():
            return
