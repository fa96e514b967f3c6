"""Worker replicas named by a flag's entries: each entry is one address gRPC dials as given, or a
`dns:///NAME:PORT` name (a Kubernetes headless Service) the gateway resolves itself into one replica
per address, again every refresh period, as pods come and go.

The model worker pool and the detok pool each keep one ReplicaSet of their own clients; the set
adds a client for each address that joins, retires (no new work) one whose address left its name,
and closes a retired one once nothing of it is open. gRPC's own dns resolver is not used for this:
one channel to a name settles on one address (pick_first), so a name's replicas would share the
load by chance and one added later would get nothing until a stream reconnected.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

import grpc

from gateway.config import dns_name
from tokenwire.grpc_tls import ClientTLS, aio_channel

logger = logging.getLogger(__name__)

class Replica(Protocol):
    address: str  # the gRPC target it dials


R = TypeVar("R", bound=Replica)
# Between two lookups while no address has resolved yet at start.
START_RESOLVE_S = 1.0


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` has now, as gRPC targets ("10.0.0.5:50051", "[fd00::5]:50051"), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    targets = set()
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])  # no IPv6 zone
        targets.add(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    return sorted(targets)


def replica_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, object]],
                    tls_name: str) -> grpc.aio.Channel:
    """A channel to one replica; `tls_name` is the DNS name it was resolved from ("" if none)."""
    options = list(options)
    if tls is not None and not tls.server_name and tls_name:
        # Resolved to a pod IP: its certificate names the Service, as the dialled name did.
        options.append(("grpc.ssl_target_name_override", tls_name))
    return aio_channel(address, tls, options)


class ReplicaSet(Generic[R]):
    """The replicas of one flag's entries (`kind` names them in logs: "model worker").

    new(address, tls_name) makes a replica's client (tls_name: the DNS name it was resolved from,
    which its certificate names, or ""); launch(replica) opens its stream once the set is started;
    idle(replica) says a retired replica has nothing open; close(replica) ends its stream and
    channel."""

    def __init__(self, kind: str, entries: list[str], refresh_s: float, new: Callable[[str, str], R],
                 launch: Callable[[R], None], idle: Callable[[R], bool],
                 close: Callable[[R], Awaitable[None]]) -> None:
        self.kind = kind
        self.entries = entries
        self.refresh_s = refresh_s
        self._new = new
        self._launch = launch
        self._idle = idle
        self._close = close
        self.replicas: list[R] = []
        # Gone from DNS: no new work; closed once what was placed there ends.
        self.retired: set[R] = set()
        # The entries that list each replica now (its own address, or dns:/// names that resolve
        # to it): retired once none does.
        self._origins: dict[R, set[str]] = {}
        self.started = False
        self._refresh_task: asyncio.Task[None] | None = None
        for entry in entries:
            if dns_name(entry) is None:
                self._add(entry, entry, "")

    @property
    def live(self) -> list[R]:
        """Replicas that may take new work when connected (not retired)."""
        return [r for r in self.replicas if r not in self.retired]

    async def resolve_until_any(self, deadline: float, now: Callable[[], float]) -> None:
        """Resolves the DNS entries, again every START_RESOLVE_S until some address is known."""
        await self.resolve_all()
        while not self.replicas:
            if now() >= deadline:
                raise TimeoutError(f"no {self.kind} address resolved before --startup-timeout-s: "
                                   f"{', '.join(self.entries)}")
            await asyncio.sleep(START_RESOLVE_S)
            await self.resolve_all()

    def start(self) -> None:
        """Launches every replica known now, those joining later as they join, and the refreshes."""
        self.started = True
        for replica in self.replicas:
            self._launch(replica)
        if any(dns_name(entry) is not None for entry in self.entries):
            self._refresh_task = asyncio.create_task(self._refresh_loop(), name=f"{self.kind} DNS refresh")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        await asyncio.gather(*(self._remove(r) for r in list(self.replicas)))

    def _add(self, address: str, origin: str, tls_name: str) -> R:
        replica = self._new(address, tls_name)
        self.replicas.append(replica)
        self._origins[replica] = {origin}
        return replica

    async def _remove(self, replica: R) -> None:
        await self._close(replica)
        self.replicas.remove(replica)
        self.retired.discard(replica)
        self._origins.pop(replica, None)

    async def resolve_all(self) -> None:
        """Adds a replica for each newly resolved address and retires those DNS no longer lists; a
        failed lookup changes nothing (a DNS hiccup must not drop healthy replicas)."""
        for entry in self.entries:
            name = dns_name(entry)
            if name is None:
                continue
            host, port = name
            try:
                addresses = await resolve(host, port)
            except OSError as exc:
                logger.warning("%ss: cannot resolve %s: %s", self.kind, entry, exc)
                continue
            known = {r.address: r for r in self.replicas}
            for address in addresses:
                replica = known.get(address)
                if replica is None:
                    logger.info("%s %s joins (from %s)", self.kind, address, entry)
                    replica = self._add(address, entry, host)
                    if self.started:
                        self._launch(replica)
                    continue
                self._origins[replica].add(entry)
                self.retired.discard(replica)  # back in DNS before its work ended
            for replica in [r for r in self.replicas if entry in self._origins[r] and r.address not in addresses]:
                self._origins[replica].discard(entry)
                if not self._origins[replica]:  # another name (or its own address) may still list it
                    logger.info("%s %s leaves (no longer in %s)", self.kind, replica.address, entry)
                    self.retired.add(replica)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.resolve_all()
                for replica in [r for r in self.retired if self._idle(r)]:
                    await self._remove(replica)
            except Exception:
                # One bad round must not end the refreshes: the next may succeed.
                logger.exception("%ss: DNS refresh failed", self.kind)
