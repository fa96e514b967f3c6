"""The gateway's side of the model worker: one multiplexed Generate stream for every request.

The pipeline queues AddRequests and aborts here; they leave in batched RequestFrames, and
each TokenFrame that comes back is handed whole to the pipeline's callback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from gateway.frame_stream import FrameStream
from gateway.worker_health import WatchedFrameStream, WorkerHealth
from tokenwire.v1 import model_worker_pb2, model_worker_pb2_grpc


class ModelWorkerClient:
    def __init__(self, channel: grpc.aio.Channel, on_frame: Callable[[model_worker_pb2.TokenFrame], None],
                 on_lost: Callable[[Exception], None]) -> None:
        self._stub = model_worker_pb2_grpc.ModelWorkerStub(channel)
        # Insertion-ordered, so adds leave in arrival order; an abort of a request still
        # queued here just drops its add, and the worker never hears of it.
        self._adds: dict[str, model_worker_pb2.AddRequest] = {}
        self._aborts: list[str] = []
        self._on_lost = on_lost
        self.health = WorkerHealth("model worker", channel)
        self.stream: FrameStream[model_worker_pb2.RequestFrame, model_worker_pb2.TokenFrame] = WatchedFrameStream(
            self.health, "model worker", channel, self._stub.Generate, self._take_frame, on_frame, self._lost)

    @property
    def connected(self) -> bool:
        """The stream is up and the worker takes new requests (not draining)."""
        return self.stream.connected and self.health.serving

    async def get_model_info(self, timeout_s: float) -> model_worker_pb2.ModelInfo:
        """Retries until the worker answers (it may still be loading weights) or timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                return await self._stub.GetModelInfo(model_worker_pb2.GetModelInfoRequest(),
                                                     timeout=max(min(remaining, 10.0), 0.1), wait_for_ready=True)
            except grpc.aio.AioRpcError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)

    async def get_load(self, timeout_s: float = 2.0) -> model_worker_pb2.WorkerLoad:
        """Queue and KV occupancy now; raises grpc.aio.AioRpcError (DEADLINE_EXCEEDED,
        UNAVAILABLE, UNIMPLEMENTED on a worker without it) rather than waiting on a dead worker."""
        return await self._stub.GetLoad(model_worker_pb2.GetLoadRequest(), timeout=timeout_s)

    def add(self, add: model_worker_pb2.AddRequest) -> None:
        self._adds[add.request_id] = add
        self.stream.wake()

    def abort(self, request_id: str) -> None:
        if self._adds.pop(request_id, None) is None:
            self._aborts.append(request_id)
            self.stream.wake()

    def _take_frame(self) -> model_worker_pb2.RequestFrame | None:
        if not self._adds and not self._aborts:
            return None
        frame = model_worker_pb2.RequestFrame(
            adds=self._adds.values(),
            aborts=[model_worker_pb2.AbortRequest(request_id=r) for r in self._aborts])
        self._adds = {}
        self._aborts = []
        return frame

    def _lost(self, error: Exception) -> None:
        # The lost call took its requests with it; the pipeline fails their HTTP requests.
        self._adds.clear()
        self._aborts.clear()
        self._on_lost(error)
