"""Whether a worker takes new work, from its grpc.health.v1 Watch stream.

ModelWorkerClient and DetokClient each own one beside their FrameStream: a worker that starts
draining (SIGTERM) turns NOT_SERVING, so the gateway stops placing new requests or sequences on
it while the ones already there finish.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.frame_stream import FrameStream

logger = logging.getLogger(__name__)

# Between two Watch calls after one failed; a dead worker is reconnected by the channel's own
# backoff (channel_ready), so this only paces a worker that keeps refusing the call.
_RETRY_S = 1.0


class WorkerHealth:
    def __init__(self, name: str, channel: grpc.aio.Channel) -> None:
        self.name = name
        self._channel = channel
        self._stub = health_pb2_grpc.HealthStub(channel)
        # Serving until told otherwise: a worker without the health service still takes work,
        # and a lost connection is the FrameStream's to report.
        self.serving = True
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"{self.name} health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            await self._channel.channel_ready()
            call = self._stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for reply in call:
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if serving != self.serving:
                        logger.warning("%s: %s", self.name, "serving again" if serving else
                                       "not serving (draining): no new work goes to it")
                    self.serving = serving
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # no health service: always serving
            finally:
                call.cancel()
            # The call ended (worker gone or restarting): a new one reports the new process.
            self.serving = True
            await asyncio.sleep(_RETRY_S)


class WatchedFrameStream(FrameStream[Any, Any]):
    """A FrameStream that starts and stops the worker's health watch with itself."""

    def __init__(self, health: WorkerHealth, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.health = health

    def launch(self) -> None:
        self.health.start()
        super().launch()

    async def close(self) -> None:
        await self.health.close()
        await super().close()
