"""The gateway's side of one detok replica: one multiplexed Detokenize stream for its sequences.

The pipeline queues opens, token ids and closes here; they leave in batched DetokenizeFrames
(one entry per sequence per frame), and each TextDeltaFrame goes to the pipeline's callback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc

from gateway.frame_stream import FrameStream
from gateway.worker_health import WatchedFrameStream, WorkerHealth
from tokenwire.v1 import detok_worker_pb2, detok_worker_pb2_grpc


class DetokClient:
    def __init__(self, index: int, address: str, channel: grpc.aio.Channel,
                 on_frame: Callable[[int, detok_worker_pb2.TextDeltaFrame], None],
                 on_lost: Callable[[int, Exception], None]) -> None:
        self.index = index
        self.address = address
        self.num_open_sequences = 0  # kept by the pipeline, for least-loaded placement
        self._stub = detok_worker_pb2_grpc.DetokenizerStub(channel)
        self._opens: dict[str, detok_worker_pb2.OpenSequence] = {}
        self._tokens: dict[str, detok_worker_pb2.SequenceTokenIds] = {}
        self._closes: list[str] = []
        self._on_lost = on_lost
        self.health = WorkerHealth(f"detok worker {address}", channel)
        self.stream: FrameStream[detok_worker_pb2.DetokenizeFrame, detok_worker_pb2.TextDeltaFrame] = \
            WatchedFrameStream(self.health, f"detok worker {address}", channel, self._stub.Detokenize,
                               self._take_frame, lambda frame: on_frame(index, frame), self._lost)

    @property
    def connected(self) -> bool:
        """The stream is up and the replica takes new sequences (not draining); the pipeline
        places new sequences only on connected replicas."""
        return self.stream.connected and self.health.serving

    def send(self, opens: Iterable[detok_worker_pb2.OpenSequence],
             tokens: Iterable[detok_worker_pb2.SequenceTokenIds]) -> None:
        for open_ in opens:
            self._opens[open_.sequence_id] = open_
        for entry in tokens:
            queued = self._tokens.get(entry.sequence_id)
            if queued is None:
                self._tokens[entry.sequence_id] = entry
            else:
                # Two TokenFrames arrived while a write was in flight: one entry per sequence.
                queued.token_ids += entry.token_ids
                queued.render_token_ids += entry.render_token_ids
                queued.finished = queued.finished or entry.finished
        self.stream.wake()

    async def render_tokens(self, request: detok_worker_pb2.RenderTokensRequest,
                            timeout_s: float = 10.0) -> detok_worker_pb2.RenderedTokens:
        """Token strings and bytes for logprobs (prompt tokens, echo); raises grpc.aio.AioRpcError."""
        return await self._stub.RenderTokens(request, timeout=timeout_s)

    def close_sequence(self, sequence_id: str) -> None:
        if self._opens.pop(sequence_id, None) is not None:
            # Never reached the worker: nothing to close there.
            self._tokens.pop(sequence_id, None)
            return
        self._tokens.pop(sequence_id, None)
        self._closes.append(sequence_id)
        self.stream.wake()

    def _take_frame(self) -> detok_worker_pb2.DetokenizeFrame | None:
        if not self._opens and not self._tokens and not self._closes:
            return None
        frame = detok_worker_pb2.DetokenizeFrame(
            opens=self._opens.values(), tokens=self._tokens.values(),
            closes=[detok_worker_pb2.CloseSequence(sequence_id=s) for s in self._closes])
        self._opens = {}
        self._tokens = {}
        self._closes = []
        return frame

    def _lost(self, error: Exception) -> None:
        self._opens.clear()
        self._tokens.clear()
        self._closes.clear()
        self._on_lost(self.index, error)
