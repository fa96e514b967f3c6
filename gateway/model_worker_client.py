"""The gateway's side of one model worker replica: one multiplexed Generate stream for its requests.

The pipeline queues AddRequests and aborts here; they leave in batched RequestFrames, and
each TokenFrame that comes back is handed whole to the pipeline's callback. Before every
(re)connect the replica's ModelInfo is checked against the model the gateway serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from gateway.frame_stream import FrameStream
from gateway.worker_health import WatchedFrameStream, WorkerHealth
from tokenwire.v1 import model_worker_pb2, model_worker_pb2_grpc

logger = logging.getLogger(__name__)

# A replica that serves another model is asked again this often (it may be redeployed).
_MISMATCH_RECHECK_S = 10.0


class ModelMismatchError(RuntimeError):
    pass


def model_mismatch(expected: model_worker_pb2.ModelInfo, actual: model_worker_pb2.ModelInfo) -> str:
    """Why a replica serving `actual` cannot share requests with one serving `expected` ('' if it can):
    the same request must tokenize, fit and decode the same wherever it is placed."""
    differences = []
    for name in ("model_id", "vocab_size", "max_model_len", "chat_template"):
        if getattr(expected, name) != getattr(actual, name):
            shown = (lambda v: f"{len(v)} chars") if name == "chat_template" else repr
            differences.append(f"{name} {shown(getattr(actual, name))} "
                               f"(expected {shown(getattr(expected, name))})")
    # The hash names the tokenizer; its directory may differ from host to host.
    same_tokenizer = (expected.tokenizer.sha256 == actual.tokenizer.sha256 and
                      (bool(expected.tokenizer.sha256) or expected.tokenizer.path == actual.tokenizer.path))
    if not same_tokenizer:
        differences.append(f"tokenizer {actual.tokenizer.path!r} sha256 {actual.tokenizer.sha256[:12]!r} "
                           f"(expected {expected.tokenizer.path!r} sha256 {expected.tokenizer.sha256[:12]!r})")
    # Where an output stops, and how a request that leaves its sampling unset samples (both from
    # generation_config.json, beside the tokenizer).
    if set(expected.eos_token_ids) != set(actual.eos_token_ids):
        differences.append(f"eos_token_ids {sorted(actual.eos_token_ids)} (expected {sorted(expected.eos_token_ids)})")
    if expected.generation_defaults != actual.generation_defaults:
        differences.append(f"generation_defaults {_one_line(actual.generation_defaults)} "
                           f"(expected {_one_line(expected.generation_defaults)})")
    return ", ".join(differences)


def _one_line(message: object) -> str:
    return " ".join(str(message).split()) or "none"


class ModelWorkerClient:
    def __init__(self, address: str, channel: grpc.aio.Channel,
                 on_frame: Callable[[model_worker_pb2.TokenFrame], None],
                 on_lost: Callable[[Exception], None]) -> None:
        self.address = address
        self.channel = channel
        self._stub = model_worker_pb2_grpc.ModelWorkerStub(channel)
        # Insertion-ordered, so adds leave in arrival order; an abort of a request still
        # queued here just drops its add, and the worker never hears of it.
        self._adds: dict[str, model_worker_pb2.AddRequest] = {}
        self._aborts: list[model_worker_pb2.AbortRequest] = []
        self._on_lost = on_lost
        # Kept by the pipeline for least-loaded placement: sequences (n per request) placed here
        # and not ended, and until when (time.monotonic()) the replica counts as full after it
        # refused an add with RESOURCE_EXHAUSTED.
        self.num_sequences = 0
        self.full_until = 0.0
        # Its --max-waiting-requests, from its first GetLoad answer since a process answered at
        # the address (a flag: fixed while the process runs); kept while it is down.
        self.max_waiting: int | None = None
        self.max_num_seqs = 0
        # The model the gateway serves (set before the stream starts); a replica whose ModelInfo
        # differs is never connected, and `refusal` says why.
        self.expected_model: model_worker_pb2.ModelInfo | None = None
        self.refusal = ""
        name = f"model worker {address}"
        self.health = WorkerHealth(name, channel)
        self.stream: FrameStream[model_worker_pb2.RequestFrame, model_worker_pb2.TokenFrame] = WatchedFrameStream(
            self.health, name, channel, self._stub.Generate, self._take_frame, on_frame, self._lost,
            before_open=self._check_model)

    @property
    def connected(self) -> bool:
        """The stream is up and the worker takes new requests (not draining)."""
        return self.stream.connected and self.health.serving

    @property
    def full(self) -> bool:
        return time.monotonic() < self.full_until

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
        load = await self._stub.GetLoad(model_worker_pb2.GetLoadRequest(), timeout=timeout_s)
        self.max_waiting = load.max_waiting
        self.max_num_seqs = load.max_num_seqs  # 0 from a worker that does not say
        return load

    async def waiting_room(self, n: int = 1, timeout_s: float = 2.0) -> int | None:
        """How many requests of n samples it takes at once at most, idle: its seats' worth and its
        waiting room. Asked once per connection; while it is down, its last answer (it is expected
        back as it was); None where not known."""
        if self.max_waiting is None and self.connected:
            try:
                await self.get_load(timeout_s)
            except grpc.aio.AioRpcError:
                return None
        if self.max_waiting is None:
            return None
        return self.max_waiting + self.max_num_seqs // max(n, 1)

    @property
    def has_queued(self) -> bool:
        """Adds or aborts wait for the sender."""
        return bool(self._adds or self._aborts)

    def add(self, add: model_worker_pb2.AddRequest) -> None:
        self._adds[add.request_id] = add
        self.stream.wake()

    def abort(self, request_id: str) -> None:
        if self._adds.pop(request_id, None) is None:
            self._aborts.append(model_worker_pb2.AbortRequest(request_id=request_id))
            self.stream.wake()

    def abort_outputs(self, request_id: str, indexes: list[int]) -> None:
        """Ends only these of the request's n outputs (one hit a stop string); the others go on."""
        self._aborts.append(model_worker_pb2.AbortRequest(request_id=request_id, indexes=indexes))
        self.stream.wake()

    async def _check_model(self) -> None:
        """Runs before each (re)connect: the process behind the address may be a new one."""
        if self.expected_model is None:
            self.max_waiting = None
            return
        info = await self._stub.GetModelInfo(model_worker_pb2.GetModelInfoRequest(), timeout=10.0,
                                             wait_for_ready=True)
        # A process answers: its flags may differ from the last one's, so its room is asked again.
        self.max_waiting = None
        mismatch = model_mismatch(self.expected_model, info)
        if mismatch and mismatch != self.refusal:
            logger.error("model worker %s refused: it serves a different model than the gateway: %s; "
                         "no requests go to it", self.address, mismatch)
        self.refusal = mismatch
        if mismatch:
            await asyncio.sleep(_MISMATCH_RECHECK_S)
            raise ModelMismatchError(f"serves a different model: {mismatch}")

    def _take_frame(self) -> model_worker_pb2.RequestFrame | None:
        if not self._adds and not self._aborts:
            return None
        frame = model_worker_pb2.RequestFrame(
            adds=self._adds.values(),
            aborts=self._aborts)
        self._adds = {}
        self._aborts = []
        return frame

    def _lost(self, error: Exception) -> None:
        # The lost call took its requests with it; the pipeline fails their HTTP requests.
        self._adds.clear()
        self._aborts.clear()
        self._on_lost(error)
