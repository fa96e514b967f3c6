"""The column fast path of a Detokenize stream: TokenColumns in, TextColumns out, numpy over the frame.

stream.py hands each frame's TokenColumns to its HandleTable. Rows of a byte-level tokenizer whose
ids fit the UTF-8 state left before them are decoded for the whole frame at once from per-id tables
(token_table.py): a few numpy gathers and one bytes join, whatever the number of sequences. Per-row
Python is left only where it must be: rows whose text may start a stop string or that hold text
back run the stop matcher here, as stream.py's loop would; a lone continuation-byte id that grows
an unfinished character interns the longer start; every other row (bytes the tables cannot vouch
for, unknown ids, the input's end, the generic path) goes through stream.py's exact per-sequence
code. The output is the same either way (tests/test_detok_columns.py runs both side by side); the
figures are in bench/README.md.

A frame of one id per row (one decode step: the frame the engine sends most) skips most of those
numpy calls, which at ~1 us each cost more than the work on 256 rows: rows whose text is just
their id's bytes get it in one C-level fetch over a per-id list, and only the others (a character
to complete, a stop to check) take per-row Python over per-id lists (_decode_one_id_rows). Rows
whose input finished in such a frame (some sequence ends on most engine steps) are ended there too
when the end adds nothing to their id's text (_finish_plain_rows), else go the exact way.

Per-handle state lives in arrays indexed by the handle. For a live handled sequence these arrays
are the truth; its DetokSequence's counts and ByteLevelDetokenizer.pending are loaded before, and
stored after, a row of it goes the exact way.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable

import numpy as np

from detok_worker.sequence import DetokSequence
from detok_worker.token_table import STUCK, VALID2, VALID2_FLAT, TokenTable, char_mask, token_table_for
from tokenwire.packing import INT32, unpack_int32
from tokenwire.v1 import detok_worker_pb2

MAX_HANDLE = (1 << 20) - 1
# The stop sets a stream keys (HandleTable._stop_sets, kept while it lives) hold at most this many
# characters: 4096 sets of 16 stops of 512 characters held 128 MB a stream (review 96).
MAX_STOP_SET_CHARS = 1 << 20
# Slot states: a handle never opened on this stream (ids for it are a gateway bug); open; or ended
# (stopped, failed, finished, closed), whose late ids are the ones the gateway sent before it
# heard, dropped quietly until the handle is opened again.
_NEVER, _LIVE, _ENDED = 0, 1, 2
# A row as the exact path takes it, from a column row or a SequenceTokenIds: (sequence, its int32 LE
# ids, input finished).
ExactRow = tuple[DetokSequence, bytes, bool]
FeedExact = Callable[[list[ExactRow]], None]
# Ends a finished sequence (a stop string hit it, or its input finished), with its last text: a
# finished TextDelta.
ReportEnded = Callable[[DetokSequence, str], None]
# Plain rows' output: handles [E], their texts concatenated (UTF-8), text lengths [E], num_tokens [E].
_Part = tuple[np.ndarray, bytes, np.ndarray, np.ndarray]
# Frames of at most this many rows, one id each, take the plain-Python lane (HandleTable._feed_few_plain).
FEW_ROWS = 8
_INT32_LE = [struct.Struct(f"<{n}i") for n in range(FEW_ROWS + 1)]
_ONE_EACH = [_INT32_LE[n].pack(*[1] * n) for n in range(FEW_ROWS + 1)]


class BadFrameError(ValueError):
    """A frame no per-sequence answer can cover (a missing sequence_id, an unknown handle); ends
    the stream."""


class HandleTable:
    """The handled sequences of one stream and their frame-loop state, all indexed by handle."""

    _ARRAYS = {"_status": (np.int8, 0), "_table_index": (np.int64, -1), "_held": (bool, False),
               "_num_tokens": (np.int64, 0), "_num_reported": (np.int64, 0), "_pending": (np.int64, 0),
               "_stop_low": (np.uint64, 0),
               "_stop_high": (np.uint64, 0), "_stop_key": (np.int64, -1), "_row_of": (np.int64, 0)}

    def __init__(self, capacity: int = 64) -> None:
        self._sequences: list[DetokSequence | None] = [None] * capacity
        # [capacity] each: _status (_NEVER/_LIVE/_ENDED); _table_index into _tables (-1: generic
        # path); _held: the stop matcher holds text back; the counts; _pending: the unfinished
        # character's bytes, interned in the sequence's TokenTable; the stop strings' first
        # characters (char_mask); _row_of: scratch, a handle's row.
        for name, (dtype, fill) in self._ARRAYS.items():
            setattr(self, name, np.full(capacity, fill, dtype=dtype))
        self._tables: list[TokenTable] = []
        self._stop_keys: dict[tuple[str, ...], int] = {}  # stop set -> _stop_key (bounded)
        self._stop_sets: list[tuple[str, ...]] = []
        self._stop_set_chars = 0  # in _stop_sets, which live as long as the stream
        # Rows of one id each take _decode_one_id_rows; False sends them through the numpy pass
        # too, only so that bench/bench_detok.py can measure both in one process.
        self.one_id_loop = True
        # Frames of a few plain rows skip numpy altogether (_feed_few_plain); False only so that
        # tests and benches can run those frames through the other lanes.
        self.few_rows_lane = True

    # ---- opening and ending ----

    def holder(self, handle: int) -> DetokSequence | None:
        """The open sequence that has this handle (ValueError for one out of range)."""
        if not 0 < handle <= MAX_HANDLE:
            raise ValueError(f"handle {handle} is out of range (1 to {MAX_HANDLE})")
        return self._sequences[handle] if handle < len(self._sequences) else None

    def bind(self, handle: int, sequence: DetokSequence) -> None:
        """Gives sequence the handle, which holder() said is free."""
        self._grow(handle)
        sequence.handle = handle
        self._sequences[handle] = sequence
        self._status[handle] = _LIVE
        self._table_index[handle] = -1
        if sequence.token_bytes is not None:
            table = token_table_for(sequence.token_bytes)
            if table not in self._tables:
                self._tables.append(table)
            self._table_index[handle] = self._tables.index(table)
        matcher = sequence.stop_matcher
        low, high = char_mask("".join(stop[0] for stop in matcher.stops)) if matcher is not None else (0, 0)
        self._stop_low[handle], self._stop_high[handle] = low, high
        self._stop_key[handle] = -1
        if matcher is not None:
            stops = tuple(matcher.stops)
            key = self._stop_keys.get(stops)
            if key is None and len(self._stop_sets) < 4096 and self._stop_set_chars < MAX_STOP_SET_CHARS:
                # (past either bound, new sets take the masks)
                key = self._stop_keys[stops] = len(self._stop_sets)
                self._stop_sets.append(stops)
                self._stop_set_chars += sum(map(len, stops))
            self._stop_key[handle] = key if key is not None else -2
        self._held[handle] = False
        self._num_tokens[handle] = self._num_reported[handle] = 0
        self._pending[handle] = 0

    def retire(self, handle: int) -> None:
        """An open with this handle failed: its late ids are dropped quietly, as an ended one's."""
        if 0 < handle <= MAX_HANDLE:
            self._grow(handle)
            if self._sequences[handle] is None:
                self._status[handle] = _ENDED

    def unbind(self, sequence: DetokSequence) -> None:
        """The sequence left the stream (any reason); its handle's late ids are dropped quietly."""
        handle = sequence.handle
        if handle and self._sequences[handle] is sequence:
            self._sequences[handle] = None
            self._status[handle] = _ENDED

    def _grow(self, handle: int) -> None:
        """Room for handle, and the last slot still free (_checked_status clips to it)."""
        capacity = len(self._sequences)
        if handle < capacity - 1:
            return
        new = max(handle + 2, 2 * capacity)
        self._sequences.extend([None] * (new - capacity))
        for name, (dtype, fill) in self._ARRAYS.items():
            grown = np.full(new, fill, dtype=dtype)
            grown[:capacity] = getattr(self, name)
            setattr(self, name, grown)

    # ---- one frame ----

    def feed(self, columns: detok_worker_pb2.TokenColumns, feed_exact: FeedExact, report_ended: ReportEnded,
             out: detok_worker_pb2.TextColumns) -> None:
        """Decodes the frame's rows: plain text into out, stop hits and plain ends of finished rows
        through report_ended, the rest through feed_exact (both add TextDeltas to the stream's reply)."""
        if self.few_rows_lane and self._feed_few_plain(columns, out):
            return
        handles, counts, ids, finished, status = self._read(columns)
        rows = handles.size
        # [rows + 1]: where each row's ids start; None when every row has exactly one id.
        token_bounds: np.ndarray | None = None
        if ids.size != rows or np.count_nonzero(counts != 1):
            if np.count_nonzero(counts < 0):
                raise BadFrameError("TokenColumns.num_tokens holds a negative count")
            token_bounds = np.zeros(rows + 1, dtype=np.int64)
            np.cumsum(counts, out=token_bounds[1:])
            if ids.size != token_bounds[-1]:
                raise BadFrameError(f"TokenColumns.num_tokens adds up to {int(token_bounds[-1])} ids, "
                                    f"token_ids holds {ids.size}")
        elif self.one_id_loop and self._feed_one_step(handles, ids, finished, status, feed_exact, report_ended,
                                                      out):
            return
        live = status == _LIVE  # [rows]; rows of ended sequences are late ids, dropped
        table_index = self._table_index[handles]
        fast = live & (table_index >= 0)
        finished_rows: list[int] = []
        finished_alone: list[int] = []  # finished handles without a row in this frame
        if finished.size:
            row_of = np.minimum(self._row_of[finished], max(rows - 1, 0))
            has_row = (handles[row_of] == finished) if rows else np.zeros(finished.size, dtype=bool)
            finished_rows = row_of[has_row].tolist()
            fast[finished_rows] = False
            finished_alone = finished[~has_row & (self._status[finished] == _LIVE)].tolist()
        idle = None
        if token_bounds is not None:
            idle = counts == 0  # no ids, not finished: nothing to do
            idle[finished_rows] = False
            fast &= ~idle
        parts: list[_Part] = []
        if np.count_nonzero(fast):
            groups = table_index[fast]
            for group in ([int(groups[0])] if not np.count_nonzero(groups != groups[0])
                          else np.unique(groups).tolist()):
                in_group = fast & (table_index == group) if len(self._tables) > 1 else fast
                part, taken = self._decode_rows(self._tables[group], handles, counts, ids, token_bounds, in_group,
                                                report_ended)
                fast[in_group] = taken
                if part is not None:
                    parts.append(part)
        self._write(parts, out)
        exact = live & ~fast
        if idle is not None:
            exact &= ~idle
        exact_rows = np.flatnonzero(exact).tolist()
        if exact_rows or finished_alone:
            self._feed_exact_rows(handles, ids, token_bounds, exact_rows, set(finished_rows),
                                  finished_alone, feed_exact)

    def _feed_few_plain(self, columns: detok_worker_pb2.TokenColumns, out: detok_worker_pb2.TextColumns) -> bool:
        """A frame of at most FEW_ROWS rows, one id each, none finished, every row plain (live, of one
        byte table, nothing pending or held, an id that fits the empty state, no byte a stop of
        the row starts with): the decode step of one or a few streams. Decoded in plain Python:
        each of the general flow's ~25 numpy calls costs ~1 us in a warm loop but 5-10 us on a
        worker that waits between frames, its caches gone cold (a one-row frame took 95-160 us in
        apply then, against 28 warm). Same state and output as _decode_one_id_rows; False, with
        nothing done, when the frame is not that (the general flow then takes it, and raises for
        a bad one)."""
        size = len(columns.handles)
        if (not size or size > 4 * FEW_ROWS or size & 3 or columns.finished_handles
                or len(columns.token_ids) != size or columns.num_tokens != _ONE_EACH[size >> 2]):
            return False
        unpack = _INT32_LE[size >> 2].unpack
        handles, ids = unpack(columns.handles), unpack(columns.token_ids)
        capacity = len(self._sequences)
        status, table_index, pending, held, stop_key = (self._status, self._table_index, self._pending, self._held,
                                                        self._stop_key)
        texts: list[bytes] = []
        # One byte table for the whole frame, as _feed_one_step asks: the general flow lists the
        # rows of several tables group by group, and the lane's rows must come out in its order.
        group = table_index.item(handles[0]) if 0 < handles[0] < capacity else -1
        if group < 0:
            return False
        table = self._tables[group]
        for handle, token_id in zip(handles, ids, strict=True):
            if (not 0 < handle < capacity or status.item(handle) != _LIVE or pending.item(handle) or held.item(handle)
                    or table_index.item(handle) != group):
                return False
            if not 0 <= token_id < table.vocab_size or not table.token_bytes.known_ids.item(token_id):
                return False
            data = table.start_pieces[token_id]
            if data is None:
                return False
            key = stop_key.item(handle)
            if key != -1 and (key == -2 or table.stop_flag(self._stop_sets[key], token_id)):
                return False
            texts.append(data)
        if len(set(handles)) != len(handles):
            return False  # the general flow refuses the frame
        out.SetInParent()  # present in every reply to a frame with columns, even empty
        num_tokens, num_reported = self._num_tokens, self._num_reported
        out_handles: list[int] = []
        out_lengths: list[int] = []
        out_counts: list[int] = []
        tail_pending = table.tail_pending_list
        for handle, token_id, data in zip(handles, ids, texts, strict=True):
            pending[handle] = tail_pending[token_id]
            count = num_tokens.item(handle) + 1
            num_tokens[handle] = count
            if data:
                out_handles.append(handle)
                out_lengths.append(len(data))
                out_counts.append(count - num_reported.item(handle))
                num_reported[handle] = count
        if out_handles:
            pack = _INT32_LE[len(out_handles)].pack
            out.handles = pack(*out_handles)
            out.text = b"".join(texts)
            out.text_lengths = pack(*out_lengths)
            out.num_tokens = pack(*out_counts)
        return True

    def _feed_one_step(self, handles: np.ndarray, ids: np.ndarray, finished: np.ndarray, status: np.ndarray,
                       feed_exact: FeedExact, report_ended: ReportEnded,
                       out: detok_worker_pb2.TextColumns) -> bool:
        """The usual frame of one decode step, without the general flow's masks (~1 us per numpy
        call): every row live, of one byte table, one valid id each. With many streams some
        sequence ends on most steps: rows whose input finished are ended here when that is plain
        (_finish_plain_rows), else go the exact way; the others take the one-id loop. False, with
        nothing done, when the frame is not that."""
        rows = handles.size
        if not rows or int(status.max()) != _LIVE:  # none is _NEVER (_read checked)
            return False
        table_index = self._table_index[handles]  # [rows]
        group = int(table_index.min())
        if group < 0 or int(table_index.max()) != group:
            return False
        table = self._tables[group]
        if not table.token_bytes.ids_are_valid(ids):
            return False
        if not finished.size:
            part, exact_rows = self._decode_one_id_rows(table, handles, ids, report_ended)
            self._write([part], out)
            if exact_rows:
                self._feed_exact_rows(handles, ids, None, exact_rows, set(), [], feed_exact)
            return True
        # _read left each handle's row in _row_of; a finished handle without a row here finds
        # another handle's row (or a stale one) there.
        row_of = np.minimum(self._row_of[finished], rows - 1)  # [F]
        has_row = handles[row_of] == finished
        finished_rows = np.unique(row_of[has_row])  # [F'] rows that end their sequence (a handle named twice: once)
        finished_alone = finished[~has_row & (self._status[finished] == _LIVE)].tolist()
        parts: list[_Part] = []
        exact_rows = self._finish_plain_rows(table, handles, ids, finished_rows, report_ended)
        if finished_rows.size < rows:
            going_on = np.ones(rows, dtype=bool)
            going_on[finished_rows] = False
            kept = np.flatnonzero(going_on)  # [K]
            part, kept_exact = self._decode_one_id_rows(table, handles[kept], ids[kept], report_ended)
            parts.append(part)
            if kept_exact:
                exact_rows = np.concatenate([exact_rows, kept[kept_exact]])
        self._write(parts, out)
        # Exact rows in row order, as the general flow feeds them. Their deltas follow those of the
        # lane's finishes and stop hits, unlike the general flow's; readers match deltas by sequence id.
        if exact_rows.size or finished_alone:
            self._feed_exact_rows(handles, ids, None, np.sort(exact_rows).tolist(), set(finished_rows.tolist()),
                                  finished_alone, feed_exact)
        return True

    def _finish_plain_rows(self, table: TokenTable, handles: np.ndarray, ids: np.ndarray, finished_rows: np.ndarray,
                           report_ended: ReportEnded) -> np.ndarray:
        """Ends the sequences of the finished rows whose last id is plain: nothing held, an id that
        fits the empty state (or completes the unfinished character before it), and no byte a stop
        of the row starts with. Their text is those bytes, less a character the id leaves
        unfinished (a stop that could start there is one with a non-ASCII first character,
        which flags every id with a non-ASCII byte): what the exact path's finish (flush the
        detokenizer, then the matcher) would give, without its cost (~20 us per finished row in
        bench_detok.py --staggered, mostly per-call overhead). Returns the other finished rows,
        their state untouched, for the exact path."""
        start_pieces = table.start_pieces
        pending, held, stop_key = self._pending, self._held, self._stop_key
        num_tokens, num_reported, sequences = self._num_tokens, self._num_reported, self._sequences
        exact_rows: list[int] = []
        for row, handle, token_id in zip(finished_rows.tolist(), handles[finished_rows].tolist(),
                                         ids[finished_rows].tolist(), strict=True):
            pending_index = pending.item(handle)
            # After an unfinished character the id must complete it exactly: text, not a longer start.
            data = start_pieces[token_id] if not pending_index else table.continue_pending(pending_index, token_id)[0]
            if data is None or held.item(handle):
                exact_rows.append(row)
                continue
            key = stop_key.item(handle)
            if key != -1:
                if key == -2:  # past the bounded stop sets: not worth a matcher check here
                    exact_rows.append(row)
                    continue
                if table.stop_flag(self._stop_sets[key], token_id):
                    exact_rows.append(row)
                    continue
            sequence = sequences[handle]
            assert sequence is not None
            sequence.num_tokens = num_tokens.item(handle) + 1
            sequence.num_reported = num_reported.item(handle)
            sequence.finished = True
            # An unfinished last character (the id's tail_pending) is dropped, as ByteLevelDetokenizer.finish.
            report_ended(sequence, data.decode("utf-8"))
        return np.array(exact_rows, dtype=np.int64)

    def _read(self, columns: detok_worker_pb2.TokenColumns) -> tuple[np.ndarray, ...]:
        """The columns as arrays, checked: every handle opened on this stream, none twice; and
        the rows' slot status."""
        try:
            handles = unpack_int32(columns.handles)  # [rows]
            counts = unpack_int32(columns.num_tokens)  # [rows]
            ids = unpack_int32(columns.token_ids)  # [num ids]
            finished = unpack_int32(columns.finished_handles)  # [num finished]
        except ValueError as exc:
            raise BadFrameError(f"TokenColumns: {exc}") from exc
        if counts.size != handles.size:
            raise BadFrameError(f"TokenColumns has {handles.size} handles and {counts.size} num_tokens")
        status = self._checked_status("handles", handles)
        if finished.size:
            self._checked_status("finished_handles", finished)
        rows = np.arange(handles.size)
        self._row_of[handles] = rows
        if self._row_of[handles].tobytes() != rows.tobytes():  # a repeated handle kept its last row only
            raise BadFrameError("TokenColumns.handles names a handle twice")
        return handles, counts, ids, finished, status

    def _checked_status(self, field: str, handles: np.ndarray) -> np.ndarray:
        """[n] slot status of the handles; BadFrameError for one never opened on this stream."""
        # Handle 0, negatives and handles past the arrays clip to slot 0 or the last slot, which
        # no handle ever holds (_grow keeps it free): _NEVER, as a slot never opened.
        status = self._status.take(handles, mode="clip")
        if handles.size and int(status.min()) == _NEVER:
            handle = int(handles[np.argmax(status == _NEVER)])
            raise BadFrameError(f"TokenColumns.{field}: handle {handle} was never opened on this stream")
        return status

    def _decode_rows(self, table: TokenTable, handles: np.ndarray, counts: np.ndarray, ids: np.ndarray,
                     token_bounds: np.ndarray | None, in_group: np.ndarray,
                     report_ended: ReportEnded) -> tuple[_Part | None, np.ndarray]:
        """The rows in_group of one byte table, decoded together. Returns the plain rows' output
        (None if none) and [rows in group] bool: which rows it took. Their state is updated; the
        others' is left as it was, for the exact path."""
        one_each = token_bounds is None
        g_handles = handles[in_group]  # [R]
        g_counts = counts[in_group]
        g_ids = ids[in_group] if one_each else ids[np.repeat(in_group, counts)]  # [n]
        taken = np.zeros(g_handles.size, dtype=bool)  # [R]
        token_bytes = table.token_bytes
        if not token_bytes.ids_are_valid(g_ids):
            # Rows with ids outside the vocabulary: the exact path names the first in its error.
            bad = g_ids.view(np.uint32) >= table.vocab_size
            bad[~bad] = ~token_bytes.known_ids[g_ids[~bad]]
            row_bad = bad if one_each else np.repeat(np.arange(g_handles.size), g_counts)[bad]
            good = np.ones(g_handles.size, dtype=bool)
            good[row_bad] = False
            narrowed = in_group.copy()
            narrowed[in_group] = good
            if not np.count_nonzero(narrowed):
                return None, taken
            part, taken[good] = self._decode_rows(table, handles, counts, ids, token_bounds, narrowed, report_ended)
            return part, taken
        if one_each and self.one_id_loop:
            part, exact_rows = self._decode_one_id_rows(table, g_handles, g_ids, report_ended)
            taken[:] = True
            taken[exact_rows] = False
            return part, taken
        bounds = None
        pending = self._pending[g_handles]  # [R]
        row_state = table.pending_state[pending]  # [R]
        if one_each:
            last_ids = g_ids  # [R]
            prev_state = row_state  # [n]: the state each id must fit
        else:
            bounds = np.zeros(g_counts.size + 1, dtype=np.int64)  # [R + 1]
            np.cumsum(g_counts, out=bounds[1:])
            last_ids = g_ids[bounds[1:] - 1]
            prev_state = np.empty(g_ids.size, dtype=np.int64)
            prev_state[1:] = table.pending_state[table.tail_pending[g_ids[:-1]]]
            prev_state[bounds[:-1]] = row_state
        second_ok = VALID2[prev_state >> 8, table.first[g_ids]]  # [n]
        head = table.head[g_ids]
        missing = prev_state & 0xFF
        fits = table.clean[g_ids] & (head == missing) & second_ok  # [n]
        if one_each and np.count_nonzero(row_state):
            # A lone id of continuation bytes that does not finish the character: the pending
            # bytes grow, no text (a 3-byte character sent as 3 one-byte ids, say).
            grows = second_ok & (head < missing) & (table.continuation_len[g_ids] > 0) & (missing != STUCK)
            if np.count_nonzero(grows):
                self._grow_pending(table, g_handles[grows], g_ids[grows], pending[grows])
                taken |= grows
        pending_len = table.pending_len[pending]  # [R]
        new_len = table.piece_lengths[g_ids]  # [n]
        maybe_stop = self._maybe_stop(table, g_handles, None if one_each else g_counts, g_ids)  # [n]
        if one_each:
            row_ok = fits  # [R]
        else:
            row_ok = _per_row_all(fits, bounds)
            maybe_stop = ~_per_row_all(~maybe_stop, bounds)
            new_len = _per_row_sum(new_len, bounds)
        text_len = pending_len + new_len - table.tail[last_ids]  # [R] bytes of new text
        # The text: per row its pending bytes (the tail of the id that left them), its ids' bytes,
        # the last id's without its tail; one join over TokenTable.join_pieces.
        vocab = table.vocab_size
        if one_each:
            piece_ids = g_ids[row_ok] + vocab
            row_start = None
        else:
            is_last = np.zeros(g_ids.size, dtype=np.int64)
            is_last[bounds[1:] - 1] = vocab
            piece_ids = (g_ids + is_last)[np.repeat(row_ok, g_counts)]
            row_start = np.zeros(g_counts.size, dtype=np.int64)
            np.cumsum(g_counts[row_ok][:-1], out=row_start[1:np.count_nonzero(row_ok)])
        with_pending = row_ok & (pending_len > 0)
        if np.count_nonzero(with_pending):
            ok_pending = with_pending[row_ok]  # among the taken rows
            at = np.flatnonzero(ok_pending) if one_each else row_start[:ok_pending.size][ok_pending]
            piece_ids = np.insert(piece_ids, at, pending[with_pending] + 2 * vocab)
        # itemgetter(*ids) fetches them all in one C call (measured: 25% under map over a list).
        text = b"".join(operator.itemgetter(*piece_ids.tolist())(table.join_pieces)) if piece_ids.size > 1 else \
            b"".join(table.join_pieces[i] for i in piece_ids.tolist())
        suspects = np.flatnonzero(row_ok & (maybe_stop | self._held[g_handles]))
        if suspects.size:
            text = self._match_stops(table, text, text_len, row_ok, taken, suspects, g_handles, g_counts, g_ids,
                                     bounds, pending, report_ended)
        # Commit the rows taken: unfinished characters, counts, one entry per row with text.
        done = g_handles[row_ok]
        done_last = last_ids[row_ok]
        self._pending[done] = table.tail_pending[done_last]
        num_tokens = self._num_tokens[done] + g_counts[row_ok]
        self._num_tokens[done] = num_tokens
        done_len = text_len[row_ok]
        with_text = done_len > 0
        out_handles = done[with_text]
        out_num_tokens = num_tokens[with_text] - self._num_reported[out_handles]
        self._num_reported[out_handles] = num_tokens[with_text]
        return (out_handles, text, done_len[with_text], out_num_tokens), row_ok | taken

    def _decode_one_id_rows(self, table: TokenTable, g_handles: np.ndarray, g_ids: np.ndarray,
                            report_ended: ReportEnded) -> tuple[_Part, list[int]]:
        """_decode_rows for rows of one (valid) id each, the frame of one decode step. Plain rows
        (nothing pending, no stop to check, an id that fits the empty state: ~75% of rows on
        bench_detok's corpus) get their text from one C-level fetch over the per-id list; only
        the others go through a Python loop, which decides as the numpy pass does with per-id
        lists (a list index costs ~20 ns, a numpy element ~100 ns, a numpy call ~1 us). Same
        state and output as the numpy pass (tests/test_detok_columns_one_id.py runs both).
        Returns the output and the rows left for the exact path, their state untouched."""
        rows = g_handles.size
        pending_before = self._pending[g_handles]  # [R]
        attention = self._held[g_handles] | self._maybe_stop(table, g_handles, None, g_ids)  # [R]: matcher
        # [R]: each row's text; plain rows' is final, the loop below replaces the others'.
        row_texts: list[bytes] = table.start_texts[g_ids].tolist()
        unplain = np.flatnonzero((pending_before != 0) | attention | ~table.fits_start[g_ids])  # [U]
        grown: list[tuple[int, int]] = []  # (handle, its longer unfinished character)
        exact_rows: list[int] = []
        if unplain.size:
            start_pieces = table.start_pieces
            trimmed_pieces = table.trimmed_pieces
            pending_info = table.pending_info
            clean_heads = table.clean_heads
            first_bytes = table.first_bytes
            for row, handle, token_id, pending, to_match in zip(
                    unplain.tolist(), g_handles[unplain].tolist(), g_ids[unplain].tolist(),
                    pending_before[unplain].tolist(), attention[unplain].tolist(), strict=True):
                if not pending:
                    data = start_pieces[token_id]
                else:
                    # Inline, the common case of TokenTable.continue_pending: the id completes the character.
                    missing, lead, pending_data = pending_info[pending]
                    if clean_heads[token_id] == missing and VALID2_FLAT[lead | first_bytes[token_id]]:
                        data = pending_data + trimmed_pieces[token_id]
                    else:
                        data, new_pending = table.continue_pending(pending, token_id)
                        if data is None and new_pending >= 0:  # the unfinished character grew: no text yet
                            grown.append((handle, new_pending))
                            row_texts[row] = b""
                            continue
                if data is not None and to_match:
                    data = self._match_row(table, handle, data, [token_id], pending, report_ended)
                    if data is None:  # a stop ended it (its state no longer matters)
                        row_texts[row] = b""
                        continue
                elif data is None:
                    exact_rows.append(row)
                    row_texts[row] = b""
                    continue
                row_texts[row] = data
        # Commit: every row as if it took its id whole (the id's tail is the unfinished
        # character), then the few that did not put right.
        self._pending[g_handles] = table.tail_pending[g_ids]
        num_tokens = self._num_tokens[g_handles] + 1  # [R]
        self._num_tokens[g_handles] = num_tokens
        for handle, new_pending in grown:
            self._pending[handle] = new_pending
        for row in exact_rows:  # as they were, for the exact path
            handle = int(g_handles[row])
            self._pending[handle] = pending_before[row]
            self._num_tokens[handle] -= 1
        lengths = np.fromiter(map(len, row_texts), dtype=np.int64, count=rows)  # [R]
        with_text = lengths > 0  # never an exact row's: its num_tokens above is not the truth
        out_handles = g_handles[with_text]  # [E]
        num_tokens = num_tokens[with_text]
        out_num_tokens = num_tokens - self._num_reported[out_handles]
        self._num_reported[out_handles] = num_tokens
        return (out_handles, b"".join(row_texts), lengths[with_text], out_num_tokens), exact_rows

    def _maybe_stop(self, table: TokenTable, g_handles: np.ndarray, g_counts: np.ndarray | None,
                    g_ids: np.ndarray) -> np.ndarray:
        """[n] bool: ids whose row's text goes to the stop matcher (_match_row); g_counts None:
        one id per row."""
        keys = self._stop_key[g_handles]
        key = int(keys[0])
        if key != -2 and not np.count_nonzero(keys != key):  # one stop set (or none) in the group
            if key < 0:
                return np.zeros(g_ids.size, dtype=bool)
            return table.stop_flags(self._stop_sets[key], g_ids)
        # Several sets: ids holding a byte a stop of their row starts with (any non-ASCII byte for
        # a stop that starts with such a character).
        stop_low = self._stop_low[g_handles]
        stop_high = self._stop_high[g_handles]
        if g_counts is not None:
            stop_low = np.repeat(stop_low, g_counts)
            stop_high = np.repeat(stop_high, g_counts)
        return ((table.mask_low[g_ids] & stop_low) | (table.mask_high[g_ids] & stop_high)) != 0

    def _grow_pending(self, table: TokenTable, handles: np.ndarray, ids: np.ndarray, pending: np.ndarray) -> None:
        for handle, token_id, index in zip(handles.tolist(), ids.tolist(), pending.tolist(), strict=True):
            self._pending[handle] = table.intern(table.pending_bytes(index) + table.token_bytes.pieces[token_id])
        self._num_tokens[handles] += 1

    def _match_stops(self, table: TokenTable, text: bytes, text_len: np.ndarray, row_ok: np.ndarray,
                     taken: np.ndarray, suspects: np.ndarray, g_handles: np.ndarray, g_counts: np.ndarray,
                     g_ids: np.ndarray, bounds: np.ndarray | None, pending: np.ndarray,
                     report_ended: ReportEnded) -> bytes:
        """The suspect rows of the numpy pass through _match_row. What the matcher lets out
        replaces the row's text (text_len follows); a row whose stop hit leaves row_ok (it is in
        taken: nothing more to do)."""
        ends = np.cumsum(np.where(row_ok, text_len, 0)).tolist()
        replaced: list[tuple[int, int, bytes]] = []
        for row, handle in zip(suspects.tolist(), g_handles[suspects].tolist(), strict=True):
            start, end = ends[row] - int(text_len[row]), ends[row]
            row_data = text[start:end]
            row_ids = g_ids[row:row + 1] if bounds is None else g_ids[bounds[row]:bounds[row + 1]]
            data = self._match_row(table, handle, row_data, row_ids.tobytes(), int(pending[row]), report_ended)
            if data is row_data:
                continue
            if data is None:
                row_ok[row] = False
                taken[row] = True
                data = b""
            else:
                text_len[row] = len(data)
            replaced.append((start, end, data))
        if not replaced:
            return text
        kept = []
        position = 0
        for start, end, data in replaced:
            kept.append(text[position:start])
            kept.append(data)
            position = end
        kept.append(text[position:])
        return b"".join(kept)

    def _match_row(self, table: TokenTable, handle: int, data: bytes, row_ids: list[int] | bytes, pending: int,
                   report_ended: ReportEnded) -> bytes | None:
        """A row whose text may touch a stop (held text, or a byte some stop starts with), as
        stream.py's frame loop takes it: could_start, then the matcher's push. Returns the bytes
        to let out (data itself when the matcher is not needed), or None when a stop hit ended
        the sequence (reported through report_ended). row_ids: the row's new ids (a list, or
        int32 LE bytes), replayed on a hit; pending: the row's unfinished character before them."""
        sequence = self._sequences[handle]
        assert sequence is not None and sequence.stop_matcher is not None and sequence.stop_search is not None
        row_text = data.decode("utf-8")
        if not (sequence.stop_matcher.held_text or sequence.stop_search(row_text)):
            return data
        num_new = len(row_ids) if isinstance(row_ids, list) else len(row_ids) >> 2
        sequence.num_tokens = self._num_tokens.item(handle) + num_new  # .item(): a Python int, fast
        sequence.detokenizer.pending_before_feed = table.pending_bytes(pending)  # for a replay
        emitted = sequence.match_stops(row_text, row_ids, num_new)
        if sequence.finished:
            sequence.num_reported = self._num_reported.item(handle)  # the stopped delta's count
            report_ended(sequence, emitted)
            return None
        self._held[handle] = bool(sequence.stop_matcher.held_text)
        return emitted.encode("utf-8")

    @staticmethod
    def _write(parts: list[_Part], out: detok_worker_pb2.TextColumns) -> None:
        out.SetInParent()  # present in every reply to a frame with columns, even empty
        parts = [part for part in parts if part[0].size]
        if not parts:
            return
        if len(parts) == 1:
            handles, text, lengths, num_tokens = parts[0]
        else:
            handles = np.concatenate([p[0] for p in parts])
            text = b"".join(p[1] for p in parts)
            lengths = np.concatenate([p[2] for p in parts])
            num_tokens = np.concatenate([p[3] for p in parts])
        out.handles = handles.astype(INT32, copy=False).tobytes()  # often the frame's own int32 handles
        out.text = text
        out.text_lengths = lengths.astype(INT32).tobytes()
        out.num_tokens = num_tokens.astype(INT32).tobytes()

    # ---- the exact way ----

    def _feed_exact_rows(self, handles: np.ndarray, ids: np.ndarray, token_bounds: np.ndarray | None,
                         rows: list[int], finished_rows: set[int], finished_alone: list[int],
                         feed_exact: FeedExact) -> None:
        """The rows the arrays could not take, through the exact per-sequence code, with the
        arrays' state loaded into their DetokSequences before and stored back after (gathered
        and scattered once for all of them: numpy's per-element access costs more)."""
        row_handles = [*handles[rows].tolist(), *finished_alone]
        ids_data = ids.tobytes()  # slicing bytes costs a tenth of slicing the array, then tobytes
        if token_bounds is None:
            row_ids = [ids_data[4 * row:4 * row + 4] for row in rows]
        else:
            bounds = (4 * token_bounds).tolist()
            row_ids = [ids_data[bounds[row]:bounds[row + 1]] for row in rows]
        row_ids.extend(b"" for _ in finished_alone)
        finished = [row in finished_rows for row in rows] + [True] * len(finished_alone)
        members: list[ExactRow] = []
        for handle, num_tokens, num_reported, pending, table_index, ids_bytes, input_finished in zip(
                row_handles, self._num_tokens[row_handles].tolist(), self._num_reported[row_handles].tolist(),
                self._pending[row_handles].tolist(), self._table_index[row_handles].tolist(), row_ids, finished,
                strict=True):
            sequence = self._sequences[handle]
            assert sequence is not None
            sequence.num_tokens = num_tokens
            sequence.num_reported = num_reported
            if table_index >= 0:
                sequence.detokenizer.pending = self._tables[table_index].pending_bytes(pending)
            members.append((sequence, ids_bytes, input_finished))
        feed_exact(members)
        still_open = [sequence for sequence, _, _ in members if self._sequences[sequence.handle] is sequence]
        if not still_open:
            return
        open_handles = [sequence.handle for sequence in still_open]
        self._num_tokens[open_handles] = [sequence.num_tokens for sequence in still_open]
        self._num_reported[open_handles] = [sequence.num_reported for sequence in still_open]
        self._held[open_handles] = [sequence.stop_matcher is not None and bool(sequence.stop_matcher.held_text)
                                    for sequence in still_open]
        self._pending[open_handles] = [
            self._tables[int(self._table_index[s.handle])].intern(s.detokenizer.pending) if s.token_bytes else 0
            for s in still_open]


def _per_row_all(flags: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """[R] bool: every flag of the row's ids ([n] flags, rows cut at bounds [R + 1])."""
    failed = np.zeros(flags.size + 1, dtype=np.int64)
    np.cumsum(~flags, out=failed[1:])
    return failed[bounds[1:]] == failed[bounds[:-1]]


def _per_row_sum(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    totals = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=totals[1:])
    return totals[bounds[1:]] - totals[bounds[:-1]]
