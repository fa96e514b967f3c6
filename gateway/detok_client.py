"""The gateway's side of one detok replica: one multiplexed Detokenize stream for its sequences.

The pipeline queues opens, token ids and closes here; they leave in batched DetokenizeFrames
(one entry per sequence per frame), and each TextDeltaFrame goes to the pipeline's callback.
Sequences given a handle (assign_handle) send their ids as TokenColumns rows and get their plain
text back as TextColumns entries (detok_worker/columns.py), which costs far less per sequence.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import grpc

from gateway.frame_stream import FrameStream, ResetStream
from gateway.worker_health import WatchedFrameStream, WorkerHealth
from tokenwire.packing import pack_int32
from tokenwire.v1 import common_pb2, detok_worker_pb2, detok_worker_pb2_grpc

logger = logging.getLogger(__name__)
K = TypeVar("K")
V = TypeVar("V")

# (sequence id, int32 LE token ids, input finished) of a handled sequence, for its TokenColumns row.
ColumnRow = tuple[str, bytes, bool]
# How often a replica that cannot load the model's tokenizer is asked again.
REFUSAL_RECHECK_S = 10.0
# A replica answers every frame within milliseconds (its tokenizer is loaded before the stream
# opens); one that has left a frame unanswered this long has hung (its event loop blocked, its
# gRPC core still answering keepalive pings): its stream is ended as lost.
STALL_TIMEOUT_S = 15.0
# The token-id bytes one DetokenizeFrame carries at most (4 a token id, logprob ids included). A
# replay after a lost replica sends every open sequence's ids at once: past gRPC's 64 MiB message
# limit the write would fail, the new replica's stream would be lost too, and its sequences
# replayed again, onto the next. Whole sequences past it wait for the next frame; a live stream's
# frames (one step's tokens) are far below it.
MAX_FRAME_ID_BYTES = 16 << 20


class ReplicaRefused(RuntimeError):
    """The replica answers but cannot take sequences: it cannot load the model's tokenizer
    (missing on its host, another file), or it hung: none go to it until it can."""


class DetokClient:
    def __init__(self, address: str, channel: grpc.aio.Channel,
                 on_frame: Callable[[DetokClient, detok_worker_pb2.TextDeltaFrame], None],
                 on_lost: Callable[[DetokClient, Exception], None], warmup_timeout_s: float = 10.0) -> None:
        self.address = address
        self.channel = channel
        self.num_open_sequences = 0  # kept by the pipeline, for least-loaded placement
        self.num_renders = 0  # RenderTokens calls in flight (a retired replica closes without any)
        self._stub = detok_worker_pb2_grpc.DetokenizerStub(channel)
        self._opens: dict[str, detok_worker_pb2.OpenSequence] = {}
        self._tokens: dict[str, detok_worker_pb2.SequenceTokenIds] = {}
        self._closes: list[str] = []
        self._on_lost = on_lost
        self._on_frame = on_frame
        # Handles of this stream (OpenSequence.handle): handle -> sequence id, and back.
        self.sequence_of_handle: list[str | None] = [None]  # index 0: no handle
        self._handles: dict[str, int] = {}
        self._free_handles: list[int] = []
        # (frame number, handle) of closed sequences: the handle is free once that frame's reply
        # is read, since replies to earlier frames may still carry the old sequence's text.
        self._closing: list[tuple[int, int]] = []
        self._rows: dict[int, list] = {}  # handle -> [ids parts, finished]: the next frame's rows
        self._num_frames_sent = 0
        self._num_replies = 0
        # Numbers of the frames sent with columns whose replies are still to come: a reply
        # without TextColumns comes from a worker that predates them.
        self._column_frames: collections.deque[int] = collections.deque()
        self.columns_supported = True
        # The model's tokenizer, once the pipeline knows it: each (re)connect warms it (_warm).
        self.tokenizer: common_pb2.TokenizerIdentity | None = None
        self._warmup_timeout_s = warmup_timeout_s
        # Why the replica takes no sequences although it answers: it cannot load the tokenizer.
        self.refusal = ""
        self.refusal_recheck_s = REFUSAL_RECHECK_S
        # When each frame still unanswered was sent (monotonic), oldest first; stalled() reads it.
        self._sent_at: collections.deque[float] = collections.deque()
        self.stall_timeout_s = STALL_TIMEOUT_S
        self.max_frame_id_bytes = MAX_FRAME_ID_BYTES
        # Id bytes queued since the last frame (at least: ids dropped with a closed sequence stay
        # counted), so a frame under the limit, every frame but a replay's, is taken whole at once.
        self._queued_id_bytes = 0
        self._last_stream_stalled = False
        self.health = WorkerHealth(f"detok worker {address}", channel)
        self.stream: FrameStream[detok_worker_pb2.DetokenizeFrame, detok_worker_pb2.TextDeltaFrame] = \
            WatchedFrameStream(self.health, f"detok worker {address}", channel, self._stub.Detokenize,
                               self._take_frame, self._reply, self._lost, before_open=self._warm,
                               stalled=self.stalled)

    @property
    def connected(self) -> bool:
        """The stream is up and the replica takes new sequences (not draining); the pipeline
        places new sequences only on connected replicas."""
        return self.stream.connected and self.health.serving

    @property
    def has_queued(self) -> bool:
        """Opens, ids or closes wait for the sender."""
        return bool(self._opens or self._tokens or self._closes or self._rows)

    def assign_handle(self, open_: detok_worker_pb2.OpenSequence) -> None:
        """Gives the sequence a handle (the most recently freed, else a new one): its ids then go
        in send()'s rows. Only for sequences that need no render_token_ids; none once the worker
        turned out not to know columns."""
        if not self.columns_supported:
            return
        handle = self._free_handles.pop() if self._free_handles else len(self.sequence_of_handle)
        if handle == len(self.sequence_of_handle):
            self.sequence_of_handle.append(None)
        self.sequence_of_handle[handle] = open_.sequence_id
        self._handles[open_.sequence_id] = handle
        open_.handle = handle

    def has_handle(self, sequence_id: str) -> bool:
        return sequence_id in self._handles

    def sequence_finished(self, sequence_id: str) -> None:
        """The worker's finished TextDelta for the sequence was read: it dropped the sequence
        after answering every frame before, and drops ids of frames already sent, so the handle
        is free now; ids still queued for it are stale and go too, lest a new sequence with the
        handle in the same frame take them."""
        handle = self._handles.pop(sequence_id, None)
        if handle is not None:
            self._rows.pop(handle, None)
            self._free_handles.append(handle)

    def send(self, opens: Iterable[detok_worker_pb2.OpenSequence],
             tokens: Iterable[detok_worker_pb2.SequenceTokenIds], rows: Iterable[ColumnRow] = ()) -> None:
        for sequence_id, token_ids, finished in rows:
            self._queued_id_bytes += len(token_ids)
            handle = self._handles[sequence_id]
            queued = self._rows.get(handle)
            if queued is None:
                self._rows[handle] = [[token_ids], finished]
            else:  # two TokenFrames arrived while a write was in flight: one row per sequence
                queued[0].append(token_ids)
                queued[1] = queued[1] or finished
        for open_ in opens:
            self._opens[open_.sequence_id] = open_
        for entry in tokens:
            self._queued_id_bytes += len(entry.token_ids) + len(entry.render_token_ids)
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
        self.num_renders += 1
        try:
            return await self._stub.RenderTokens(request, timeout=timeout_s)
        finally:
            self.num_renders -= 1

    def close_sequence(self, sequence_id: str) -> None:
        handle = self._handles.get(sequence_id)
        if handle is not None:
            self._rows.pop(handle, None)
        if self._opens.pop(sequence_id, None) is not None:
            # Never reached the worker: nothing to close there, and the handle is free at once.
            self._tokens.pop(sequence_id, None)
            self.sequence_finished(sequence_id)
            return
        self._tokens.pop(sequence_id, None)
        self._closes.append(sequence_id)
        self.stream.wake()

    async def _warm(self) -> None:
        """Before each stream opens: one RenderTokens of one id with the model's tokenizer, so the
        replica loads it (and builds its tables) now. Otherwise the first request it gets waits for
        that (measured with SmolLM2: a first streamed completion's first byte came 1.21 s after
        the request against 0.03 s for the next ones). A replica that cannot load it at all
        (FAILED_PRECONDITION: no tokenizer.json on its host, another file) is refused, as a model
        worker serving another model is: its stream stays closed, so no sequence fails there (it
        would have the fewest open and get every request), /ready lists it, and it is asked again
        every refusal_recheck_s. Any other failure is only logged: the stream opens anyway (after
        at most the warm-up timeout), and a request waits for the load, as before."""
        if self.tokenizer is None:
            return
        try:
            await self.render_tokens(detok_worker_pb2.RenderTokensRequest(tokenizer=self.tokenizer,
                                                                          token_ids=pack_int32([0])),
                                     self._warmup_timeout_s)
        except grpc.aio.AioRpcError as exc:
            hung = self._last_stream_stalled and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION and not hung:
                logger.warning("detok worker %s: warming tokenizer %s failed (%s: %s)", self.address,
                               self.tokenizer.path, exc.code().name, exc.details())
                self.refusal = ""  # the stream opens: an earlier refusal no longer holds
                self._last_stream_stalled = False
                return
            refusal = (f"cannot load the model's tokenizer: {exc.details()}" if not hung else
                       "hung: its last stream answered no frame, and it does not answer now")
            if refusal != self.refusal:
                logger.error("detok worker %s refused: %s; no sequences go to it", self.address, refusal)
            self.refusal = refusal
            await asyncio.sleep(self.refusal_recheck_s)
            raise ReplicaRefused(refusal) from None
        if self.refusal:
            logger.info("detok worker %s answers and loads the model's tokenizer now", self.address)
        self.refusal = ""
        self._last_stream_stalled = False

    def stalled(self) -> str | None:
        """Why the stream is to end as lost: its oldest frame has gone unanswered too long."""
        if self._sent_at and time.monotonic() - self._sent_at[0] > self.stall_timeout_s:
            self._last_stream_stalled = True
            return f"the detok worker answered no frame for {self.stall_timeout_s:g} s"
        return None

    def _take_frame(self) -> detok_worker_pb2.DetokenizeFrame | None:
        if not self.has_queued:
            return None
        tokens, rows = self._tokens, self._rows
        self._tokens, self._rows = {}, {}
        if self._queued_id_bytes > self.max_frame_id_bytes:
            room = self.max_frame_id_bytes
            tokens, self._tokens, room = _split_at(tokens, _entry_id_bytes, room, always_first=True)
            rows, self._rows, _ = _split_at(rows, _row_id_bytes, room, always_first=not tokens)
        self._queued_id_bytes = (sum(map(_entry_id_bytes, self._tokens.values()))
                                 + sum(map(_row_id_bytes, self._rows.values()))) if self._tokens or self._rows else 0
        frame = detok_worker_pb2.DetokenizeFrame(
            opens=self._opens.values(), tokens=tokens.values(),
            closes=[detok_worker_pb2.CloseSequence(sequence_id=s) for s in self._closes])
        self._num_frames_sent += 1
        self._sent_at.append(time.monotonic())
        if rows:
            handles = [h for h, (parts, _) in rows.items() if any(parts)]
            columns = frame.columns
            columns.handles = pack_int32(handles)
            columns.num_tokens = pack_int32([_row_id_bytes(rows[h]) >> 2 for h in handles])
            columns.token_ids = b"".join(part for h in handles for part in rows[h][0])
            columns.finished_handles = pack_int32([h for h, (_, finished) in rows.items() if finished])
            self._column_frames.append(self._num_frames_sent)
        for sequence_id in self._closes:
            handle = self._handles.pop(sequence_id, None)
            if handle is not None:
                self._closing.append((self._num_frames_sent, handle))
        self._opens = {}
        self._closes = []
        if self._tokens or self._rows:
            self.stream.wake()  # what waits goes in the next frame, once this one is written
        return frame

    def _reply(self, frame: detok_worker_pb2.TextDeltaFrame) -> None:
        self._num_replies += 1
        if self._sent_at:
            self._sent_at.popleft()
        if self._column_frames and self._column_frames[0] == self._num_replies:
            self._column_frames.popleft()
            if not frame.HasField("columns"):
                # This worker dropped the columns unread: the handled sequences would never get
                # text, and frames already in flight carry more rows it will drop. End the stream
                # once (its requests fail, every handle is forgotten, the worker frees what it
                # opened) and send per-sequence entries on the next one.
                self.columns_supported = False
                logger.error("detok worker %s does not read TokenColumns (older version); "
                             "reopening the stream with per-sequence entries", self.address)
                raise ResetStream("the detok worker does not read TokenColumns (an older version)")
        try:
            self._on_frame(self, frame)
        finally:
            if self._closing and self._closing[0][0] <= self._num_replies:
                # Frames are answered one for one, in order: this reply ends the closed
                # sequences' text, so their handles can take new sequences.
                self._free_handles.extend(h for n, h in self._closing if n <= self._num_replies)
                self._closing = [(n, h) for n, h in self._closing if n > self._num_replies]

    def _lost(self, error: Exception) -> None:
        self._opens.clear()
        self._tokens.clear()
        self._closes.clear()
        # A new stream starts with no handles open.
        self._rows.clear()
        self._handles.clear()
        self._free_handles.clear()
        self._closing.clear()
        self._column_frames.clear()
        self.sequence_of_handle = [None]
        self._num_frames_sent = self._num_replies = 0
        self._sent_at.clear()
        self._queued_id_bytes = 0
        self._on_lost(self, error)


def _entry_id_bytes(entry: detok_worker_pb2.SequenceTokenIds) -> int:
    return len(entry.token_ids) + len(entry.render_token_ids)


def _row_id_bytes(row: list) -> int:
    return sum(map(len, row[0]))


def _split_at(queued: dict[K, V], size_of: Callable[[V], int], room: int,
              always_first: bool) -> tuple[dict[K, V], dict[K, V], int]:
    """(the entries that go in this frame, those that wait, the room left): entries in order while
    their sizes fit in room (the first one whatever its size when always_first), then none. All
    of them, as they are, when they fit: the common case costs one len() an entry."""
    taken: dict[K, V] = {}
    for key, value in queued.items():
        size = size_of(value)
        if size > room and (taken or not always_first):
            waiting = dict(itertools.islice(queued.items(), len(taken), None))
            return taken, waiting, room
        taken[key] = value
        room -= size
    return queued, {}, room
