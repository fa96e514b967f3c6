"""The gateway's model worker replicas: least-loaded placement over them, one model across them, and
their addresses from a list or from DNS (a Kubernetes headless Service), re-resolved as pods change.

The Pipeline owns one ModelWorkerPool and places each request on `pick()`; every replica is a
ModelWorkerClient with its own stream, health watch and reconnect, so losing one touches only
the requests placed on it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Collection

from gateway.config import Config, dns_name
from gateway.frame_stream import status_text, wait_any_connected
from gateway.model_worker_client import ModelWorkerClient
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.grpc_tls import aio_channel
from tokenwire.v1 import model_worker_pb2

logger = logging.getLogger(__name__)

# Between two lookups while no address has resolved yet at start.
_START_RESOLVE_S = 1.0
# After the first replica's ModelInfo, how long the others get to answer, so the first listed
# (not the fastest) sets the model served when replicas disagree.
_INFO_GRACE_S = 2.0


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` has now, as gRPC targets ("10.0.0.5:50051", "[fd00::5]:50051"), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    targets = set()
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])  # no IPv6 zone
        targets.add(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    return sorted(targets)


class ModelWorkerPool:
    def __init__(self, config: Config,
                 on_frame: Callable[[ModelWorkerClient, model_worker_pb2.TokenFrame], None],
                 on_lost: Callable[[ModelWorkerClient, Exception], None]) -> None:
        self._config = config
        self._on_frame = on_frame
        self._on_lost = on_lost
        self.replicas: list[ModelWorkerClient] = []
        # Gone from DNS: no new requests; closed once the ones placed there end.
        self._retired: set[ModelWorkerClient] = set()
        # The --model-workers entry each replica came from (itself, or its dns:/// name).
        self._origin: dict[ModelWorkerClient, str] = {}
        self._next = 0  # round robin among equally loaded replicas
        self.model_info = model_worker_pb2.ModelInfo()
        self._started = False
        self._refresh_task: asyncio.Task[None] | None = None
        for address in config.model_workers:
            if dns_name(address) is None:
                self._add(address, address, "")

    @property
    def live(self) -> list[ModelWorkerClient]:
        """Replicas that may take new requests when connected (not retired)."""
        return [r for r in self.replicas if r not in self._retired]

    @property
    def any_connected(self) -> bool:
        return any(r.connected for r in self.live)

    def pick(self, exclude: Collection[ModelWorkerClient] = ()) -> ModelWorkerClient | None:
        """The connected replica with the fewest live sequences, preferring one that has not refused
        an add as full within the last second; ties go round robin. None if none is connected."""
        count = len(self.replicas)
        in_turn = [self.replicas[(self._next + i) % count] for i in range(count)]
        candidates = [r for r in in_turn if r.connected and r not in self._retired and r not in exclude]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda r: (r.full, r.num_sequences))
        self._next = (self.replicas.index(chosen) + 1) % count
        return chosen

    async def start(self, timeout_s: float) -> None:
        """Resolves the DNS entries, takes the model of the first replica that answers as the one
        served, then opens every replica's stream and waits until one is connected."""
        deadline = time.monotonic() + timeout_s
        await self._resolve_all()
        while not self.replicas:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no model worker address resolved within {timeout_s:.0f}s: "
                                   f"{', '.join(self._config.model_workers)}")
            await asyncio.sleep(_START_RESOLVE_S)
            await self._resolve_all()
        self.model_info = await self._first_model_info(deadline)
        logger.info("model workers serve %s (max_model_len %d); replicas: %s", self.model_info.model_id,
                    self.model_info.max_model_len, ", ".join(r.address for r in self.replicas))
        self._started = True
        for replica in self.replicas:
            self._launch(replica)
        if not await wait_any_connected([r.stream for r in self.replicas], max(deadline - time.monotonic(), 1.0)):
            refused = [f"{r.address} ({r.refusal})" for r in self.replicas if r.refusal]
            raise TimeoutError(f"no model worker stream within {timeout_s:.0f}s"
                               + (f"; refused: {'; '.join(refused)}" if refused else ""))
        if any(dns_name(a) is not None for a in self._config.model_workers):
            self._refresh_task = asyncio.create_task(self._refresh_loop(), name="model worker DNS refresh")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        await asyncio.gather(*(self._close(r) for r in list(self.replicas)))

    def down(self) -> list[str]:
        """Each live replica that takes no new requests now, and why."""
        reasons = []
        for replica in self.live:
            if replica.connected:
                continue
            why = (f"serves a different model: {replica.refusal}" if replica.refusal else
                   "draining" if replica.stream.connected else "stream down")
            reasons.append(f"model worker {replica.address} ({why})")
        return reasons

    async def _first_model_info(self, deadline: float) -> model_worker_pb2.ModelInfo:
        """The model the gateway serves: that of the first-listed replica among those answering
        GetModelInfo within _INFO_GRACE_S of the first answer (they may still be loading weights)."""
        asks = [asyncio.create_task(r.get_model_info(max(deadline - time.monotonic(), 0.1))) for r in self.replicas]
        try:
            done, pending = await asyncio.wait(asks, return_when=asyncio.FIRST_COMPLETED)
            while pending and all(task.exception() is not None for task in done):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if pending:
                await asyncio.wait(pending, timeout=_INFO_GRACE_S)
            for task in asks:  # in list order
                if task.done() and task.exception() is None:
                    return task.result()
            raise TimeoutError("no model worker answered GetModelInfo before --startup-timeout-s: " + "; ".join(
                f"{r.address}: {status_text(t.exception())}" for r, t in zip(self.replicas, asks, strict=True)))
        finally:
            for task in asks:
                task.cancel()
            await asyncio.gather(*asks, return_exceptions=True)

    def _add(self, address: str, origin: str, tls_name: str) -> ModelWorkerClient:
        options = list(CHANNEL_OPTIONS)
        tls = self._config.worker_tls
        if tls is not None and not tls.server_name and tls_name:
            # Resolved to a pod IP: its certificate names the Service, as the dialled name did.
            options.append(("grpc.ssl_target_name_override", tls_name))
        channel = aio_channel(address, tls, options)
        replica = ModelWorkerClient(address, channel, lambda frame: self._on_frame(replica, frame),
                                    lambda error: self._on_lost(replica, error))
        self.replicas.append(replica)
        self._origin[replica] = origin
        return replica

    def _launch(self, replica: ModelWorkerClient) -> None:
        replica.expected_model = self.model_info
        replica.stream.launch()

    async def _close(self, replica: ModelWorkerClient) -> None:
        await replica.stream.close()
        await replica.channel.close()
        self.replicas.remove(replica)
        self._retired.discard(replica)
        self._origin.pop(replica, None)

    async def _resolve_all(self) -> None:
        """Adds a replica for each newly resolved address and retires those DNS no longer lists; a
        failed lookup changes nothing (a DNS hiccup must not drop healthy replicas)."""
        for entry in self._config.model_workers:
            name = dns_name(entry)
            if name is None:
                continue
            host, port = name
            try:
                addresses = await resolve(host, port)
            except OSError as exc:
                logger.warning("model workers: cannot resolve %s: %s", entry, exc)
                continue
            known = {r.address: r for r in self.replicas}
            for address in addresses:
                replica = known.get(address)
                if replica is None:
                    logger.info("model worker %s joins (from %s)", address, entry)
                    replica = self._add(address, entry, host)
                    if self._started:
                        self._launch(replica)
                elif replica in self._retired:
                    self._retired.discard(replica)  # back in DNS before its requests ended
            gone = [r for r in self.replicas if self._origin[r] == entry and r.address not in addresses
                    and r not in self._retired]
            for replica in gone:
                logger.info("model worker %s leaves (no longer in %s)", replica.address, entry)
                self._retired.add(replica)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.model_worker_dns_refresh_s)
            try:
                await self._resolve_all()
                # Once its requests ended and their aborts went out (a close drops what is queued).
                for replica in [r for r in self._retired if r.num_sequences == 0 and not r.has_queued]:
                    await self._close(replica)
            except Exception:
                # One bad round must not end the refreshes: the next may succeed.
                logger.exception("model workers: DNS refresh failed")
