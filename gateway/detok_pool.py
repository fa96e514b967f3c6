"""The gateway's detok replicas: one DetokClient (one Detokenize stream) per replica, from
--detok-workers' addresses and dns:/// names (resolved into one replica per address, again every
--detok-worker-dns-refresh-s, so a replica an autoscaler adds takes sequences within seconds), and
least-loaded placement over the connected ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from gateway.config import Config, dns_name
from gateway.detok_client import DetokClient
from gateway.replica_set import ReplicaSet, replica_channel
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.v1 import common_pb2, detok_worker_pb2

logger = logging.getLogger(__name__)

# Each channel its own connections, for a plain HOST:PORT entry listed more than once whose name has
# several addresses (grpc-core resolves those, not the gateway): sharing subchannels, every entry
# settled on the address that connected first (4 entries for 2 replicas: one connection, in 3 of 3
# starts); apart, each picks its own at random (pick_first's shuffleAddressList).
DETOK_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


class DetokPool:
    def __init__(self, config: Config, on_frame: Callable[[DetokClient, detok_worker_pb2.TextDeltaFrame], None],
                 on_lost: Callable[[DetokClient, Exception], None]) -> None:
        self._config = config
        self._on_frame = on_frame
        self._on_lost = on_lost
        # Each replica warms the model's tokenizer before its stream opens (DetokClient._warm).
        self.tokenizer: common_pb2.TokenizerIdentity | None = None
        # A dns:/// name once: each of its addresses gets one stream (before the gateway resolved
        # names itself, a name was listed once per stream wanted). A plain address listed twice
        # still gets two streams.
        entries = [e for i, e in enumerate(config.detok_workers)
                   if dns_name(e, "--detok-workers") is None or config.detok_workers.index(e) == i]
        if len(entries) < len(config.detok_workers):
            logger.warning("--detok-workers lists a dns:/// name more than once: each of its addresses "
                           "gets one stream whatever the count")
        self._set = ReplicaSet("detok worker", entries, config.detok_worker_dns_refresh_s, self._new,
                               self._launch, _idle, _close)

    @property
    def replicas(self) -> list[DetokClient]:
        """Every replica, retired ones (gone from DNS, sequences still open there) included."""
        return self._set.replicas

    @property
    def live(self) -> list[DetokClient]:
        """Replicas that may take new sequences when connected (not retired)."""
        return self._set.live

    def pick(self, exclude: Collection[DetokClient] = ()) -> DetokClient | None:
        """The connected live replica with the fewest open sequences; None if there is none."""
        connected = [d for d in self.live if d.connected and d not in exclude]
        return min(connected, key=lambda d: d.num_open_sequences) if connected else None

    async def start(self, tokenizer: common_pb2.TokenizerIdentity, deadline: float,
                    now: Callable[[], float]) -> None:
        """Resolves the DNS entries and launches every replica's stream (each warms `tokenizer`
        first); those joining later launch as they join."""
        self.tokenizer = tokenizer
        await self._set.resolve_until_any(deadline, now)
        self._set.start()

    async def close(self) -> None:
        await self._set.close()

    def _new(self, address: str, tls_name: str) -> DetokClient:
        channel = replica_channel(address, self._config.worker_tls, DETOK_CHANNEL_OPTIONS, tls_name)
        return DetokClient(address, channel, self._on_frame, self._on_lost, self._config.detok_warmup_timeout_s)

    def _launch(self, replica: DetokClient) -> None:
        replica.tokenizer = self.tokenizer
        replica.stream.launch()


def _idle(replica: DetokClient) -> bool:
    """Nothing of it in use: no open sequence, nothing queued, no RenderTokens call (echo's come
    after its sequence ends, and closing the channel under one failed its request with a bare 500;
    review 99)."""
    return replica.num_open_sequences == 0 and not replica.has_queued and replica.num_renders == 0


async def _close(replica: DetokClient) -> None:
    await replica.stream.close()
    await replica.channel.close()
