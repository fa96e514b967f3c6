"""gateway.worker_health: the gateway's view of whether a worker takes new work, driven by a real
in-process grpc.health.v1 server on loopback (SERVING -> NOT_SERVING on drain -> gone -> back).
"""

from __future__ import annotations

import asyncio
import time

from grpc_health.v1 import health_pb2

from gateway.worker_health import WorkerHealth
from tokenwire import grpc_server
from tokenwire.grpc_tls import add_port, aio_channel
from tokenwire.stack import free_port


async def until(predicate, timeout_s: float = 3.0) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def start_health_server(address: str):
    server = grpc_server.new_server()
    health = grpc_server.add_health_and_reflection(server, [])
    await grpc_server.mark_serving(health, [])
    add_port(server, address, None)
    await server.start()
    return server, health


async def test_health_follows_drain_loss_and_return() -> None:
    address = f"127.0.0.1:{free_port()}"
    server, health = await start_health_server(address)
    async with aio_channel(address, None, grpc_server.CHANNEL_OPTIONS) as channel:
        watch = WorkerHealth("test worker", channel)
        watch.start()
        try:
            await asyncio.sleep(0.2)
            assert watch.serving
            await health.enter_graceful_shutdown()  # what serve_until_signal does on SIGTERM
            seen_s = await until(lambda: not watch.serving)
            await server.stop(None)
            # The lost watch leaves the verdict to the stream (serving until told otherwise)...
            await until(lambda: watch.serving)
            # ...and the watch follows the next process on that address once the channel is back
            # (its reconnect backoff is capped at 5 s).
            server, health = await start_health_server(address)
            await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await until(lambda: not watch.serving, timeout_s=10.0)
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            await until(lambda: watch.serving)
        finally:
            await watch.close()
            await server.stop(None)
    assert seen_s < 1.0
