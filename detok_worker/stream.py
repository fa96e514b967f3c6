"""The state of one Detokenize stream: many sequences, one DetokenizeFrame in, one TextDeltaFrame out.

The pure core of the detok worker: servicer.py only feeds it the stream's frames. Byte-level
sequences are decoded a whole frame at a time (one id check, one Rust decode per tokenizer);
the per-sequence Python work left is slicing the bytes, UTF-8 decoding, stop matching and the
TextDelta. render_token_ids of an entry are rendered (render.py) into its sequence's delta.
Sequences opened with a handle take their ids in TokenColumns instead: columns.py decodes those
for the whole frame and hands back the rows that need the exact code here (_feed_rows).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable

import numpy as np

from detok_worker.columns import BadFrameError, ExactRow, HandleTable
from detok_worker.incremental import new_detokenizer
from detok_worker.render import renderer_for
from detok_worker.sequence import DetokSequence
from detok_worker.stop_strings import StopStringMatcher
from detok_worker.token_bytes import TokenBytes, TokenizerDecoding, decoding_for_identity
from tokenwire.packing import unpack_int32, unpack_int32_list
from tokenwire.v1 import common_pb2, detok_worker_pb2

# Ids of sequences ended by a stop string are remembered so that the tokens the model worker
# sent before the gateway's abort reached it are dropped quietly, not answered with errors;
# bounded because a gateway need not close them.
MAX_REMEMBERED_STOPPED = 4096

OpenDecoding = Callable[[common_pb2.TokenizerIdentity], TokenizerDecoding]
__all__ = ["BadFrameError", "DetokenizeStream", "OpenDecoding"]


class DetokenizeStream:
    def __init__(self, open_decoding: OpenDecoding = decoding_for_identity) -> None:
        self._open_decoding = open_decoding
        self._live: dict[str, DetokSequence] = {}
        self._columns = HandleTable()  # the handled ones among them
        self._stopped: dict[str, None] = {}  # insertion-ordered set, oldest evicted first
        self._reply = detok_worker_pb2.TextDeltaFrame()
        self._deltas: dict[str, detok_worker_pb2.TextDelta] = {}
        # This frame's sequences with rendered token ids, and their deltas.
        self._rendered: list[tuple[DetokSequence, detok_worker_pb2.TextDelta]] = []

    @property
    def live_sequence_ids(self) -> list[str]:
        return list(self._live)

    def apply(self, frame: detok_worker_pb2.DetokenizeFrame) -> detok_worker_pb2.TextDeltaFrame:
        """Opens, then token ids, then closes, as the proto orders them. At most one TextDelta
        per sequence: those with new text or that finished (stop, input end or error)."""
        self._reply = detok_worker_pb2.TextDeltaFrame()
        self._deltas = {}
        self._rendered = []
        for request in frame.opens:
            self._open(request)
        if frame.tokens:
            self._feed(frame.tokens)
        if frame.HasField("columns"):
            self._columns.feed(frame.columns, self._feed_rows, self._report_ended, self._reply.columns)
        for close in frame.closes:
            if not close.sequence_id:
                raise BadFrameError("CloseSequence.sequence_id is empty")
            # Dropped without a flush: the request was aborted, nobody reads its text.
            sequence = self._live.pop(close.sequence_id, None)
            if sequence is not None:
                self._columns.unbind(sequence)
            self._stopped.pop(close.sequence_id, None)
        return self._reply

    def _open(self, request: detok_worker_pb2.OpenSequence) -> None:
        sequence_id = request.sequence_id
        if not sequence_id:
            raise BadFrameError("OpenSequence.sequence_id is empty")
        handle = request.handle
        if sequence_id in self._live:
            # The finished error delta closes the id for the gateway, so drop the live one too.
            self._columns.unbind(self._live.pop(sequence_id))
            self._columns.retire(handle)
            self._emit_error(sequence_id, f"sequence {sequence_id!r} is already open on this stream")
            return
        self._stopped.pop(sequence_id, None)
        if handle:
            try:
                holder = self._columns.holder(handle)
            except ValueError as exc:
                self._emit_error(sequence_id, str(exc))
                return
            if holder is not None:
                # Which of the two the gateway means is unknowable: both end, both are told.
                self._fail(holder, f"handle {handle} was opened again, for sequence {sequence_id!r}")
                self._columns.retire(handle)
                self._emit_error(sequence_id, f"handle {handle} is already used by open sequence "
                                              f"{holder.sequence_id!r}")
                return
        try:
            decoding = self._open_decoding(request.tokenizer)
        except Exception as exc:  # any load failure is this sequence's, not the stream's
            self._columns.retire(handle)
            self._emit_error(sequence_id, f"cannot load tokenizer {request.tokenizer.path!r}: {exc}")
            return
        try:
            detokenizer = new_detokenizer(decoding, request.skip_special_tokens, request.prompt_tail_ids)
            stop_matcher = (StopStringMatcher(request.stop, request.include_stop_str_in_output)
                            if request.stop else None)
        except ValueError as exc:
            self._columns.retire(handle)
            self._emit_error(sequence_id, str(exc))
            return
        sequence = DetokSequence(sequence_id, detokenizer, stop_matcher, renderer_for(decoding), request.min_tokens)
        self._live[sequence_id] = sequence
        if handle:
            self._columns.bind(handle, sequence)

    def _feed(self, entries: Iterable[detok_worker_pb2.SequenceTokenIds]) -> None:
        """Byte-level entries are collected per tokenizer and decoded after this pass, so a
        bad entry (odd length, unknown id) fails its sequence for the whole frame."""
        live = self._live
        # The common frame: every entry a plain one of a byte-level sequence of one tokenizer.
        # Those take the first branch below, all else (other tables, errors, renders, the
        # generic path) goes through _sort_entry.
        table: TokenBytes | None = None
        members: list[ExactRow] = []
        byte_level: dict[TokenBytes, list[ExactRow]] = {}
        for entry in entries:
            sequence = live.get(entry.sequence_id)
            token_ids = entry.token_ids
            if (sequence is not None and sequence.token_bytes is table and table is not None
                    and not len(token_ids) & 3 and not entry.render_token_ids and not sequence.handle):
                members.append((sequence, token_ids, entry.finished))
                continue
            sorted_to = self._sort_entry(entry, sequence, byte_level)
            if table is None and sorted_to is not None:
                table = sorted_to
                members = byte_level[table]
        for token_bytes, table_members in byte_level.items():
            self._feed_byte_level(token_bytes, table_members)
        for sequence, delta in self._rendered:
            # A rendered sequence gets a delta even without text; it accounts for its ids too.
            if not delta.finished:
                delta.num_tokens += sequence.take_num_tokens()

    def _sort_entry(self, entry: detok_worker_pb2.SequenceTokenIds, sequence: DetokSequence | None,
                    byte_level: dict[TokenBytes, list[ExactRow]]) -> TokenBytes | None:
        """Every entry but the frame loop's plain byte-level one: answers errors, renders,
        feeds a generic sequence at once, or files a byte-level one under its table (which
        it returns)."""
        sequence_id = entry.sequence_id
        if sequence is None:
            if not sequence_id:
                raise BadFrameError("SequenceTokenIds.sequence_id is empty")
            if sequence_id in self._stopped:
                if entry.finished:
                    del self._stopped[sequence_id]
                return None
            self._emit_error(sequence_id, f"no open sequence {sequence_id!r} on this stream")
            return None
        if sequence.handle:
            self._fail(sequence, f"sequence {sequence_id!r} was opened with handle {sequence.handle}: "
                                 "its ids belong in DetokenizeFrame.columns")
            return None
        token_ids = entry.token_ids
        if len(token_ids) & 3:
            self._fail(sequence, f"token_ids has {len(token_ids)} bytes, not a multiple of 4 (int32 LE)")
            return None
        if entry.render_token_ids and not self._render(sequence, entry.render_token_ids):
            return None
        token_bytes = sequence.token_bytes
        if token_bytes is None:
            self._feed_one(sequence, token_ids, entry.finished)
            return None
        byte_level.setdefault(token_bytes, []).append((sequence, token_ids, entry.finished))
        return token_bytes

    def _feed_rows(self, rows: list[ExactRow]) -> None:
        """Column rows the arrays could not take (columns.py), through the same exact code as
        SequenceTokenIds entries."""
        byte_level: dict[TokenBytes, list[ExactRow]] = {}
        for row in rows:
            sequence = row[0]
            if sequence.token_bytes is None:
                self._feed_one(*row)
            else:
                byte_level.setdefault(sequence.token_bytes, []).append(row)
        for token_bytes, members in byte_level.items():
            self._feed_byte_level(token_bytes, members)

    def _report_ended(self, sequence: DetokSequence, text: str) -> None:
        """A column row that ended its sequence in columns.py: its text hit a stop string, or its
        input finished with nothing held back (sequence.finished is set either way)."""
        self._report(sequence, text, not sequence.stopped)

    def _render(self, sequence: DetokSequence, render_token_ids: bytes) -> bool:
        """Renders the ids into the sequence's delta of this frame; False if it failed."""
        try:
            ids = unpack_int32(render_token_ids)
            sequence.renderer.check_ids(ids)
        except ValueError as exc:
            self._fail(sequence, f"render_token_ids: {exc}")
            return False
        delta = self._delta_for(sequence.sequence_id)
        if delta.finished:
            return False
        sequence.renderer.render_into(delta.rendered, ids)
        self._rendered.append((sequence, delta))
        return True

    def _feed_one(self, sequence: DetokSequence, token_ids: bytes, input_finished: bool) -> None:
        """The generic path: one sequence at a time through its WindowDetokenizer."""
        if sequence.finished:  # stopped or failed earlier in this frame
            return
        try:
            text = sequence.feed(unpack_int32_list(token_ids))
        except ValueError as exc:
            self._fail(sequence, str(exc))
            return
        if input_finished and not sequence.finished:
            text += sequence.finish()
        self._report(sequence, text, input_finished)

    def _feed_byte_level(self, token_bytes: TokenBytes, members: list[ExactRow]) -> None:
        """All of one tokenizer's sequences in this frame: one check and one decode of the
        concatenated ids, then each sequence takes its slice of the bytes.

        The loop below is the worker's hot path, one pass per sequence per frame, so it does
        inline what ByteLevelDetokenizer.feed_bytes, StopStringMatcher.push and _emit_text
        would (a Python call costs about as much as the work itself): UTF-8 decoding with the
        unfinished tail held back, the stop matcher only for text that could hold a stop,
        and one TextDelta per sequence."""
        buffers = [token_ids for _, token_ids, _ in members]
        ids = unpack_int32(b"".join(buffers))  # [n] int32
        if not token_bytes.ids_are_valid(ids):
            self._feed_byte_level(token_bytes, self._drop_out_of_vocab(token_bytes, members))
            return
        blob = token_bytes.decode(ids)
        # [len(members) + 1]: where each sequence's ids, then its bytes, start in the frame's.
        token_bounds = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, buffers), dtype=np.int64, count=len(buffers)) >> 2, out=token_bounds[1:])
        byte_offsets = np.zeros(ids.size + 1, dtype=np.int64)  # [n + 1]: bytes before each id
        np.cumsum(token_bytes.piece_lengths[ids], out=byte_offsets[1:])
        byte_bounds = byte_offsets[token_bounds].tolist()
        num_new = np.diff(token_bounds).tolist()  # [len(members)]: ids per sequence
        deltas = self._deltas
        add_delta = self._reply.deltas.add
        utf_8_decode = codecs.utf_8_decode
        for (sequence, token_ids, input_finished), start, end, num_new_tokens in zip(
                members, byte_bounds[:-1], byte_bounds[1:], num_new, strict=True):
            if sequence.finished:  # stopped or failed earlier in this frame
                continue
            detokenizer = sequence.detokenizer
            pending = detokenizer.pending
            data = pending + blob[start:end] if pending else blob[start:end]
            # Python's incremental UTF-8 decoder (as ByteLevelDetokenizer.feed_bytes).
            text, consumed = utf_8_decode(data, "replace", False)
            if consumed != len(data):
                detokenizer.pending = data[consumed:]
            elif pending:
                detokenizer.pending = b""
            num_tokens = sequence.num_tokens + num_new_tokens
            sequence.num_tokens = num_tokens
            stop_search = sequence.stop_search
            if stop_search is not None and (stop_search(text) or sequence.stop_matcher.held_text):
                detokenizer.pending_before_feed = pending  # for the replay, on a hit
                text = sequence.match_stops(text, token_ids, num_new_tokens)
            if input_finished or sequence.finished:
                self._report(sequence, text + sequence.finish(), input_finished)
            elif text:
                sequence_id = sequence.sequence_id
                num_unreported = num_tokens - sequence.num_reported
                sequence.num_reported = num_tokens
                delta = deltas.get(sequence_id)
                if delta is None:
                    # Fields set one by one: upb's keyword constructor is slower.
                    delta = deltas[sequence_id] = add_delta()
                    delta.sequence_id = sequence_id
                    delta.text = text
                    delta.stop_index = -1
                    delta.num_tokens = num_unreported
                else:
                    delta.text += text
                    delta.num_tokens += num_unreported

    def _drop_out_of_vocab(self, token_bytes: TokenBytes, members: list[ExactRow]) -> list[ExactRow]:
        """Fails the sequences that sent ids outside the vocabulary; returns the others."""
        valid = []
        for member in members:
            try:
                token_bytes.check_ids(unpack_int32(member[1]))
            except ValueError as exc:
                self._fail(member[0], str(exc))
            else:
                valid.append(member)
        return valid

    def _report(self, sequence: DetokSequence, text: str, input_finished: bool) -> None:
        if not sequence.finished:
            if text:
                self._emit_text(sequence, text)
            return
        del self._live[sequence.sequence_id]
        self._columns.unbind(sequence)
        if sequence.stopped and not input_finished:
            self._remember_stopped(sequence.sequence_id)
        delta = self._delta_for(sequence.sequence_id)
        if delta.finished:
            return
        # Fields set only when they change: each upb field access costs ~0.1 us, and a frame where
        # every sequence finishes reports hundreds of these.
        if text:
            delta.text += text
        delta.num_tokens += sequence.take_num_tokens()
        delta.finished = True
        if sequence.stop_index >= 0:
            delta.stop_index = sequence.stop_index
            delta.num_tokens_to_stop = sequence.num_tokens_to_stop

    def _remember_stopped(self, sequence_id: str) -> None:
        self._stopped[sequence_id] = None
        if len(self._stopped) > MAX_REMEMBERED_STOPPED:
            del self._stopped[next(iter(self._stopped))]

    def _fail(self, sequence: DetokSequence, error: str) -> None:
        sequence.finished = True
        self._live.pop(sequence.sequence_id, None)
        self._columns.unbind(sequence)
        self._emit_error(sequence.sequence_id, error)

    def _emit_error(self, sequence_id: str, error: str) -> None:
        delta = self._delta_for(sequence_id)
        # The same sequence twice in one frame: the first reason it finished is the one reported.
        if not delta.finished:
            delta.finished = True
            delta.error = error

    def _emit_text(self, sequence: DetokSequence, text: str) -> None:
        delta = self._delta_for(sequence.sequence_id)
        delta.text += text
        delta.num_tokens += sequence.take_num_tokens()

    def _delta_for(self, sequence_id: str) -> detok_worker_pb2.TextDelta:
        """This frame's one delta for the sequence; several SequenceTokenIds of one sequence,
        or an error after text, fold into it."""
        delta = self._deltas.get(sequence_id)
        if delta is None:
            # Fields set one by one: upb's keyword constructor is slower.
            delta = self._deltas[sequence_id] = self._reply.deltas.add()
            delta.sequence_id = sequence_id
            delta.stop_index = -1
        return delta
