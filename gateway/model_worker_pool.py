"""The gateway's model worker replicas: least-loaded placement over them, one model across them, and
their addresses from a list or from DNS (a Kubernetes headless Service), re-resolved as pods change.

The Pipeline owns one ModelWorkerPool and places each request on `pick()`; every replica is a
ModelWorkerClient with its own stream, health watch and reconnect, so losing one touches only
the requests placed on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from gateway.config import Config
from gateway.frame_stream import status_text, wait_any_connected
from gateway.model_worker_client import ModelWorkerClient
from gateway.replica_set import ReplicaSet, replica_channel
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.v1 import model_worker_pb2

logger = logging.getLogger(__name__)

# After the first replica's ModelInfo, how long the others get to answer, so the first listed
# (not the fastest) sets the model served when replicas disagree.
_INFO_GRACE_S = 2.0


class ModelWorkerPool:
    def __init__(self, config: Config,
                 on_frame: Callable[[ModelWorkerClient, model_worker_pb2.TokenFrame], None],
                 on_lost: Callable[[ModelWorkerClient, Exception], None]) -> None:
        self._config = config
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._next = 0  # round robin among equally loaded replicas
        self.model_info = model_worker_pb2.ModelInfo()
        # Idle once its requests ended and their aborts went out (a close drops what is queued).
        self._set = ReplicaSet("model worker", config.model_workers, config.model_worker_dns_refresh_s,
                               self._new, self._launch, lambda r: r.num_sequences == 0 and not r.has_queued,
                               _close)

    @property
    def replicas(self) -> list[ModelWorkerClient]:
        return self._set.replicas

    @property
    def live(self) -> list[ModelWorkerClient]:
        """Replicas that may take new requests when connected (not retired)."""
        return self._set.live

    @property
    def any_connected(self) -> bool:
        return any(r.connected for r in self.live)

    def pick(self, exclude: Collection[ModelWorkerClient] = ()) -> ModelWorkerClient | None:
        """The connected replica with the fewest live sequences, preferring one that has not refused
        an add as full within the last second; ties go round robin. None if none is connected."""
        count = len(self.replicas)
        in_turn = [self.replicas[(self._next + i) % count] for i in range(count)]
        candidates = [r for r in in_turn if r.connected and r not in self._set.retired and r not in exclude]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda r: (r.full, r.num_sequences))
        self._next = (self.replicas.index(chosen) + 1) % count
        return chosen

    async def start(self, timeout_s: float) -> None:
        """Resolves the DNS entries, takes the model of the first replica that answers as the one
        served, then opens every replica's stream and waits until one is connected."""
        deadline = time.monotonic() + timeout_s
        await self._set.resolve_until_any(deadline, time.monotonic)
        self.model_info = await self._first_model_info(deadline)
        logger.info("model workers serve %s (max_model_len %d); replicas: %s", self.model_info.model_id,
                    self.model_info.max_model_len, ", ".join(r.address for r in self.replicas))
        self._set.start()
        if not await wait_any_connected([r.stream for r in self.replicas], max(deadline - time.monotonic(), 1.0)):
            refused = [f"{r.address} ({r.refusal})" for r in self.replicas if r.refusal]
            raise TimeoutError(f"no model worker stream within {timeout_s:.0f}s"
                               + (f"; refused: {'; '.join(refused)}" if refused else ""))

    async def close(self) -> None:
        await self._set.close()

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

    def _new(self, address: str, tls_name: str) -> ModelWorkerClient:
        channel = replica_channel(address, self._config.worker_tls, CHANNEL_OPTIONS, tls_name)
        replica = ModelWorkerClient(address, channel, lambda frame: self._on_frame(replica, frame),
                                    lambda error: self._on_lost(replica, error))
        return replica

    def _launch(self, replica: ModelWorkerClient) -> None:
        replica.expected_model = self.model_info
        replica.stream.launch()


async def _close(replica: ModelWorkerClient) -> None:
    await replica.stream.close()
    await replica.channel.close()
