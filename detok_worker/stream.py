"""The state of one Detokenize stream: many sequences, one DetokenizeFrame in, one TextDeltaFrame out.

The pure core of the detok worker: servicer.py only feeds it the stream's frames. Byte-level
sequences are decoded a whole frame at a time (one id check, one Rust decode per tokenizer);
the per-sequence Python work left is slicing the bytes, UTF-8 decoding and stop matching.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import numpy as np

from detok_worker.incremental import new_detokenizer
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
# (sequence, its int32 LE token ids, the input-finished flag) of one SequenceTokenIds.
_TokenEntry = tuple[DetokSequence, bytes, bool]


class BadFrameError(ValueError):
    """A frame no per-sequence answer can cover (a missing sequence_id); ends the stream."""


class DetokenizeStream:
    def __init__(self, open_decoding: OpenDecoding = decoding_for_identity) -> None:
        self._open_decoding = open_decoding
        self._live: dict[str, DetokSequence] = {}
        self._stopped: dict[str, None] = {}  # insertion-ordered set, oldest evicted first
        self._reply = detok_worker_pb2.TextDeltaFrame()
        self._deltas: dict[str, detok_worker_pb2.TextDelta] = {}

    @property
    def live_sequence_ids(self) -> list[str]:
        return list(self._live)

    def apply(self, frame: detok_worker_pb2.DetokenizeFrame) -> detok_worker_pb2.TextDeltaFrame:
        """Opens, then token ids, then closes, as the proto orders them. At most one TextDelta
        per sequence: those with new text or that finished (stop, input end or error)."""
        self._reply = detok_worker_pb2.TextDeltaFrame()
        self._deltas = {}
        for request in frame.opens:
            self._open(request)
        if frame.tokens:
            self._feed(frame.tokens)
        for close in frame.closes:
            if not close.sequence_id:
                raise BadFrameError("CloseSequence.sequence_id is empty")
            # Dropped without a flush: the request was aborted, nobody reads its text.
            self._live.pop(close.sequence_id, None)
            self._stopped.pop(close.sequence_id, None)
        return self._reply

    def _open(self, request: detok_worker_pb2.OpenSequence) -> None:
        sequence_id = request.sequence_id
        if not sequence_id:
            raise BadFrameError("OpenSequence.sequence_id is empty")
        if sequence_id in self._live:
            # The finished error delta closes the id for the gateway, so drop the live one too.
            del self._live[sequence_id]
            self._emit_error(sequence_id, f"sequence {sequence_id!r} is already open on this stream")
            return
        self._stopped.pop(sequence_id, None)
        try:
            decoding = self._open_decoding(request.tokenizer)
        except Exception as exc:  # any load failure is this sequence's, not the stream's
            self._emit_error(sequence_id, f"cannot load tokenizer {request.tokenizer.path!r}: {exc}")
            return
        try:
            detokenizer = new_detokenizer(decoding, request.skip_special_tokens, request.prompt_tail_ids)
            stop_matcher = (StopStringMatcher(request.stop, request.include_stop_str_in_output)
                            if request.stop else None)
        except ValueError as exc:
            self._emit_error(sequence_id, str(exc))
            return
        self._live[sequence_id] = DetokSequence(sequence_id, detokenizer, stop_matcher)

    def _feed(self, entries: Iterable[detok_worker_pb2.SequenceTokenIds]) -> None:
        """Byte-level entries are collected per tokenizer and decoded after this pass, so a
        bad entry (odd length, unknown id) fails its sequence for the whole frame."""
        byte_level: dict[TokenBytes, list[_TokenEntry]] = {}
        live = self._live
        for entry in entries:
            sequence_id = entry.sequence_id
            sequence = live.get(sequence_id)
            if sequence is None:
                if not sequence_id:
                    raise BadFrameError("SequenceTokenIds.sequence_id is empty")
                if sequence_id in self._stopped:
                    if entry.finished:
                        del self._stopped[sequence_id]
                    continue
                self._emit_error(sequence_id, f"no open sequence {sequence_id!r} on this stream")
                continue
            token_ids = entry.token_ids
            if len(token_ids) % 4:
                self._fail(sequence, f"token_ids has {len(token_ids)} bytes, not a multiple of 4 (int32 LE)")
                continue
            token_bytes = sequence.token_bytes
            if token_bytes is None:
                self._feed_one(sequence, token_ids, entry.finished)
                continue
            members = byte_level.get(token_bytes)
            if members is None:
                members = byte_level[token_bytes] = []
            members.append((sequence, token_ids, entry.finished))
        for token_bytes, members in byte_level.items():
            self._feed_byte_level(token_bytes, members)

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

    def _feed_byte_level(self, token_bytes: TokenBytes, members: list[_TokenEntry]) -> None:
        """All of one tokenizer's sequences in this frame: one check and one decode of the
        concatenated ids, then each sequence takes its slice of the bytes."""
        ids = unpack_int32(b"".join([token_ids for _, token_ids, _ in members]))  # [n] int32
        if not token_bytes.ids_are_valid(ids):
            self._feed_byte_level(token_bytes, self._drop_out_of_vocab(token_bytes, members))
            return
        blob = token_bytes.decode(ids)
        token_bounds = [0, *itertools.accumulate(len(token_ids) >> 2 for _, token_ids, _ in members)]
        byte_offsets = np.zeros(ids.size + 1, dtype=np.int64)  # [n + 1]: bytes before each id
        np.cumsum(token_bytes.piece_lengths[ids], out=byte_offsets[1:])
        byte_bounds = byte_offsets[token_bounds].tolist()
        for (sequence, token_ids, input_finished), start, end in zip(
                members, byte_bounds[:-1], byte_bounds[1:], strict=True):
            if sequence.finished:  # stopped or failed earlier in this frame
                continue
            text = sequence.feed_bytes(blob[start:end], token_ids)
            if input_finished or sequence.finished:
                self._report(sequence, text + sequence.finish(), input_finished)
            elif text:
                self._emit_text(sequence.sequence_id, text)

    def _drop_out_of_vocab(self, token_bytes: TokenBytes, members: list[_TokenEntry]) -> list[_TokenEntry]:
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
                self._emit_text(sequence.sequence_id, text)
            return
        del self._live[sequence.sequence_id]
        if sequence.stopped and not input_finished:
            self._remember_stopped(sequence.sequence_id)
        self._emit(sequence.sequence_id, text, finished=True, stop_index=sequence.stop_index,
                   num_tokens_to_stop=sequence.num_tokens_to_stop)

    def _remember_stopped(self, sequence_id: str) -> None:
        self._stopped[sequence_id] = None
        if len(self._stopped) > MAX_REMEMBERED_STOPPED:
            del self._stopped[next(iter(self._stopped))]

    def _fail(self, sequence: DetokSequence, error: str) -> None:
        sequence.finished = True
        self._live.pop(sequence.sequence_id, None)
        self._emit_error(sequence.sequence_id, error)

    def _emit_error(self, sequence_id: str, error: str) -> None:
        self._emit(sequence_id, "", finished=True, error=error)

    def _emit_text(self, sequence_id: str, text: str) -> None:
        """The common case of _emit: new text, nothing finished."""
        if sequence_id in self._deltas:
            self._emit(sequence_id, text)
        else:
            self._deltas[sequence_id] = self._reply.deltas.add(sequence_id=sequence_id, text=text, stop_index=-1)

    def _emit(self, sequence_id: str, text: str, finished: bool = False, stop_index: int = -1,
              num_tokens_to_stop: int = 0, error: str = "") -> None:
        delta = self._deltas.get(sequence_id)
        if delta is None:
            self._deltas[sequence_id] = self._reply.deltas.add(
                sequence_id=sequence_id, text=text, finished=finished, stop_index=stop_index,
                num_tokens_to_stop=num_tokens_to_stop, error=error)
            return
        # The same sequence twice in one frame (several SequenceTokenIds, or an error after
        # text): fold into the one delta; the first reason it finished is the one reported.
        if delta.finished:
            return
        delta.text += text
        if finished:
            delta.finished = True
            delta.stop_index = stop_index
            delta.num_tokens_to_stop = num_tokens_to_stop
            delta.error = error
