"""How the gateway's channels (tokenwire.grpc_server.CHANNEL_OPTIONS) use a name with several
addresses (a Kubernetes headless Service): each channel sticks to one address picked at random,
so a client's stream, health watch and load calls reach the same worker, channels spread over
the addresses, and calls after that worker dies go to a live one. In-process servers on two
loopback IPs.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenwire import grpc_server
from tokenwire.grpc_tls import add_port, aio_channel
from tokenwire.stack import free_port

ADDRESSES = ("127.0.0.1", "127.0.0.2")  # all of 127/8 is loopback on Linux


class NamedHealth(health_pb2_grpc.HealthServicer):
    """Counts which server answered."""

    def __init__(self, name: str, hits: Counter[str]) -> None:
        self.name = name
        self.hits = hits

    async def Check(self, request, context):
        self.hits[self.name] += 1
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
async def two_servers() -> AsyncIterator[tuple[str, dict[str, grpc.aio.Server], Counter[str]]]:
    port = free_port()
    hits: Counter[str] = Counter()
    servers = {}
    for ip in ADDRESSES:
        server = grpc_server.new_server()
        health_pb2_grpc.add_HealthServicer_to_server(NamedHealth(ip, hits), server)
        try:
            add_port(server, f"{ip}:{port}", None)
        except OSError:
            pytest.skip(f"cannot bind {ip}:{port}")
        await server.start()
        servers[ip] = server
    # The ipv4: scheme resolves to both addresses, as DNS does for a headless Service.
    yield f"ipv4:{ADDRESSES[0]}:{port},{ADDRESSES[1]}:{port}", servers, hits
    for server in servers.values():
        await server.stop(None)


async def check(stub: health_pb2_grpc.HealthStub) -> None:
    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)


async def test_each_channel_sticks_to_one_address_and_channels_spread(two_servers) -> None:
    target, _, hits = two_servers
    pinned: Counter[str] = Counter()
    for _ in range(24):
        async with aio_channel(target, None, grpc_server.CHANNEL_OPTIONS) as channel:
            before = hits.copy()
            for _ in range(4):
                await check(health_pb2_grpc.HealthStub(channel))
            (address,) = (hits - before).keys()  # all four calls reached one server
            pinned[address] += 1
    # Shuffled per channel: both addresses get channels (all 24 on one: p = 2 * 2**-24).
    assert set(pinned) == set(ADDRESSES), pinned


async def test_calls_after_the_worker_dies_go_to_the_live_one(two_servers) -> None:
    target, servers, hits = two_servers
    async with aio_channel(target, None, grpc_server.CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await check(stub)
        (first,) = hits.keys()
        await servers[first].stop(None)
        hits.clear()
        for _ in range(4):
            await asyncio.wait_for(check(stub), 10)
    (other,) = set(ADDRESSES) - {first}
    assert hits == Counter({other: 4})


async def test_detok_channels_open_together_spread_over_the_addresses(two_servers) -> None:
    # The gateway opens all its --detok-workers channels at once, to one name. Sharing grpc-core's
    # subchannels they all settled on the address that connected first (a headless Service's
    # 2 replicas: 1 connection, 3 starts of 3); each with its own pool they pick apart.
    from gateway.detok_pool import DETOK_CHANNEL_OPTIONS

    target, _, hits = two_servers
    rounds = []
    for _ in range(6):
        channels = [aio_channel(target, None, DETOK_CHANNEL_OPTIONS) for _ in range(4)]
        try:
            before = hits.copy()
            for channel in channels:
                await check(health_pb2_grpc.HealthStub(channel))
            rounds.append(set((hits - before).keys()))
        finally:
            for channel in channels:
                await channel.close()
    # Some round's 4 open channels reached both servers (none of 6 did: p = (1/8)**6).
    assert any(reached == set(ADDRESSES) for reached in rounds), rounds
