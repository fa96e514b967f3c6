"""Drives the engine from asyncio: steps run in one named executor thread, and adds/aborts
from every Generate stream are applied between steps, so no engine state needs a lock.

Sits between the servicer (which owns gRPC streams) and the synchronous LLMEngine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from model_worker.engine import LLMEngine, RequestRejected, SequenceOutput
from model_worker.sequence import FinishReason, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool


@dataclass
class RequestFailure:
    """A request that ended without running: rejected at admission."""

    request_id: str
    code: grpc.StatusCode
    message: str


@dataclass
class StreamOutbox:
    """Per-Generate-stream state: its live requests and the outputs waiting to be framed."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # request_id -> engine seq_id for requests of this stream that have not finished
    live: dict[str, int] = field(default_factory=dict)


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One thread: the engine is single-threaded, and torch uses its own pool inside.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._seq_ids = itertools.count()
        self._owners: dict[int, tuple[StreamOutbox, str]] = {}
        self._pending_adds: list[tuple[StreamOutbox, int, NewRequest]] = []
        self._pending_aborts: list[int] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=True)

    def add(self, outbox: StreamOutbox, request: NewRequest) -> None:
        seq_id = next(self._seq_ids)
        outbox.live[request.request_id] = seq_id
        self._pending_adds.append((outbox, seq_id, request))
        self._wake.set()

    def abort(self, outbox: StreamOutbox, request_id: str) -> None:
        seq_id = outbox.live.get(request_id)
        if seq_id is not None:
            self._pending_aborts.append(seq_id)
            self._wake.set()

    def abort_all(self, outbox: StreamOutbox) -> None:
        for request_id in list(outbox.live):
            self.abort(outbox, request_id)

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for outbox, seq_id, req in adds:
            try:
                self.engine.add_request(seq_id, req.prompt_token_ids, req.sampling, req.max_tokens,
                                        req.stop_token_ids, req.ignore_eos)
                self._owners[seq_id] = (outbox, req.request_id)
            except RequestRejected as exc:
                outbox.live.pop(req.request_id, None)
                outbox.queue.put_nowait(RequestFailure(req.request_id, exc.code, exc.message))
        aborts, self._pending_aborts = self._pending_aborts, []
        for seq_id in aborts:
            owner = self._owners.pop(seq_id, None)
            if owner is None or not self.engine.abort_request(seq_id):
                continue
            outbox, request_id = owner
            outbox.live.pop(request_id, None)
            outbox.queue.put_nowait((request_id, SequenceOutput(seq_id, None, finish_reason=FinishReason.ABORT)))

    def _route(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            owner = self._owners.get(out.seq_id)
            if owner is None:  # aborted while the step ran; its abort output was sent
                continue
            outbox, request_id = owner
            if out.finish_reason != FinishReason.NONE:
                del self._owners[out.seq_id]
                outbox.live.pop(request_id, None)
            outbox.queue.put_nowait((request_id, out))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_work():
                self._wake.clear()
                if self._pending_adds or self._pending_aborts:
                    continue
                await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self.executor, self.engine.step)
            except Exception:
                logger.exception("engine step failed; failing its requests")
                self._fail_all("engine step failed; see the model worker's log")
                continue
            self._route(outputs)

    def _fail_all(self, message: str) -> None:
        for seq_id, (outbox, request_id) in list(self._owners.items()):
            self.engine.abort_request(seq_id)
            outbox.live.pop(request_id, None)
            outbox.queue.put_nowait(RequestFailure(request_id, grpc.StatusCode.INTERNAL, message))
        self._owners.clear()
