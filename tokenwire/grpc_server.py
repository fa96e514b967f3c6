"""gRPC server plumbing shared by both workers: health service, reflection, options.

Each worker's __main__ builds its servicer, then calls serve_forever, so both workers
answer grpc.health.v1 and server reflection (grpcurl works against either).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

# Frames carry many sequences; the 4 MiB default is too small for a 256-sequence frame
# with top-20 logprobs, and prompts of a full context arrive in one AddRequest.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=CHANNEL_OPTIONS)


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


async def serve_until_signal(server: grpc.aio.Server, address: str, grace_s: float = 5.0) -> None:
    """Binds address, starts, and stops gracefully on SIGINT/SIGTERM."""
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    logger.info("listening on %s", address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        logger.info("stopping (grace %.1fs)", grace_s)
        await server.stop(grace_s)
    waiter.cancel()
    stopper.cancel()
