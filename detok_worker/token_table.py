"""Per-id tables of one byte-level tokenizer for the column fast path (columns.py).

Built once per byte table and process: how each id's bytes split into continuation bytes, whole
characters and an unfinished tail; the interned unfinished-character starts; which ids may make a
row's text start a stop string of a given set.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable

import numpy as np

from detok_worker.stop_strings import StopStringMatcher
from detok_worker.token_bytes import TokenBytes, TokenizerDecoding, decoding_for_identity
from tokenwire.v1 import common_pb2


def held_back(data: bytes) -> bool:
    """CPython's incremental UTF-8 decoder (final=False) holds data back whole, as a character
    still to be completed, rather than answering U+FFFD."""
    return bool(data) and codecs.utf_8_decode(data, "replace", False)[1] == 0


def _utf8_tables() -> tuple[np.ndarray, np.ndarray]:
    """NEED[b]: bytes of the character lead byte b starts (1 for ASCII and bytes that cannot lead).
    VALID2[lead, second]: a character starting with these two bytes is valid once complete (row
    0: nothing to check, all True). CPython holds some starts back that can never complete
    validly (ED A0: a surrogate), so holding and completing are checked apart."""
    need = np.ones(256, dtype=np.int64)
    need[0xC2:0xE0], need[0xE0:0xF0], need[0xF0:0xF5] = 2, 3, 4
    valid2 = np.zeros((256, 256), dtype=bool)
    valid2[0] = True
    for lead in range(0xC2, 0xF5):
        for second in range(0x80, 0xC0):
            try:
                bytes([lead, second, *[0x80] * (int(need[lead]) - 2)]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            valid2[lead, second] = True
    return need, valid2


NEED, VALID2 = _utf8_tables()
# VALID2 flattened for one-id lookups: VALID2_FLAT[lead << 8 | second].
VALID2_FLAT = VALID2.tobytes()
# A pending state no id completes on the fast path: the exact path takes the row.
STUCK = 0xFF
# Stop-start masks: ASCII byte b < 64 is bit b of the low word, 64 <= b < 128 bit b - 64 of the
# high word; bit 63 of the high word (shared with DEL) stands for "any byte >= 0x80".
_NON_ASCII_BIT = 1 << 63


def char_mask(chars: str) -> tuple[int, int]:
    """(low, high) mask of these characters (code points < 256 stand for bytes)."""
    low = high = 0
    for char in chars:
        code = ord(char)
        if code < 64:
            low |= 1 << code
        elif code < 128:
            high |= 1 << (code - 64)
        else:
            high |= _NON_ASCII_BIT
    return low, high


class TokenTable:
    """What the frame loop needs per id of one byte table, precomputed (~0.1 s per 50k ids).

    An id's bytes read as [head: continuation bytes][whole characters][tail: the start of a
    character that CPython holds back]. A row's ids fit together when each id's head is exactly
    what the state before it (the row's pending bytes, or the previous id's tail) misses; the
    row's text is then its bytes up to the last id's tail, which becomes the pending bytes.
    Pending bytes are interned (at most ~37k valid starts exist): handles hold their index."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self.token_bytes = token_bytes
        pieces = token_bytes.pieces
        size = self.vocab_size = len(pieces)
        self.piece_lengths = token_bytes.piece_lengths  # [V]
        self.clean = np.zeros(size, dtype=bool)  # [V]: splits as above, middle valid, tail held
        self.head = np.zeros(size, dtype=np.int64)  # [V]: leading continuation bytes
        self.tail = np.zeros(size, dtype=np.int64)  # [V]: trailing held-back bytes
        self.tail_pending = np.zeros(size, dtype=np.int64)  # [V]: interned tail (0: none)
        # [V]: bytes of an id made only of continuation bytes (it may add to pending bytes), else 0.
        self.continuation_len = np.zeros(size, dtype=np.int64)
        self.first = np.zeros(size, dtype=np.int64)  # [V]: first byte (0 for an empty piece)
        self.mask_low = np.zeros(size, dtype=np.uint64)  # [V]: bytes present, char_mask layout
        self.mask_high = np.zeros(size, dtype=np.uint64)
        # Interned pending bytes: index 0 is b"". pending_state[p]: the bytes the character
        # misses, | lead << 8 when its second byte is still to come and must pass VALID2;
        # STUCK when it cannot complete validly. Grown by intern().
        self._pending_index: dict[bytes, int] = {}
        self.pending_len = np.zeros(64, dtype=np.int64)
        self.pending_state = np.zeros(64, dtype=np.int64)
        # The same per interned start for the one-id row loop: (bytes missing, lead << 8, the bytes).
        self.pending_info: list[tuple[int, int, bytes]] = []
        # Pieces to join: [0, V) whole, [V, 2V) without the tail, 2V + p the interned pending p.
        trimmed = list(pieces)
        self.join_pieces: list[bytes] = []
        self.intern(b"")
        for token_id, piece in enumerate(pieces):
            if piece:
                self.first[token_id] = piece[0]
                self.mask_low[token_id], self.mask_high[token_id] = char_mask(piece.decode("latin-1"))
            self._split(token_id, piece, trimmed)
        self.join_pieces = [*pieces, *trimmed, *self.join_pieces]
        self._stop_states: dict[tuple[str, ...], tuple[np.ndarray, Callable[[str], bool]]] = {}
        # The one-id row loop (columns.py) reads ids one at a time: Python lists, as indexing a
        # list costs ~20 ns and a numpy element ~100 ns. trimmed_pieces[i]: id i's bytes without
        # its tail; start_pieces[i]: the same when the id fits the empty state (fits_start: clean,
        # no head), else None; clean_heads[i]: its head when clean, else -1 (no pending state
        # misses -1 bytes); first_bytes[i]: its first byte.
        self.trimmed_pieces = trimmed
        self.fits_start = self.clean & (self.head == 0)  # [V]
        self.start_pieces: list[bytes | None] = [
            piece if fits else None for piece, fits in zip(trimmed, self.fits_start.tolist(), strict=True)]
        # [V] object: start_pieces with b"" for None, the plain rows' text, fetched for a whole
        # frame by one gather (a third of the time of tolist() and operator.itemgetter).
        self.start_texts = np.empty(size, dtype=object)
        self.start_texts[:] = [piece or b"" for piece in self.start_pieces]
        self.tail_pending_list: list[int] = self.tail_pending.tolist()
        self.first_bytes: list[int] = self.first.tolist()
        self.clean_heads: list[int] = np.where(self.clean, self.head, -1).tolist()

    def stop_flags(self, stops: tuple[str, ...], token_ids: np.ndarray) -> np.ndarray:
        """[n] bool: a row of each id may need the stop matcher (for this stop set).

        Ids holding no byte a stop starts with cannot. When every stop starts with an ASCII
        character, a row's text can only start a stop inside an id's whole characters (a
        character completed across ids is not ASCII), so those ids are checked with
        StopStringMatcher.could_start on those characters, each id once per set as it first
        comes: checking the whole vocabulary for each new set cost 30-56 ms of the event loop
        (SmolLM2, 16 stops), and a frame finishing 300 requests of their own stops 9.3 s (review 96)."""
        state, could_start = self._stop_state(stops)
        flags = state[token_ids]
        unknown = flags < 0
        if unknown.any():
            for token_id in set(token_ids[unknown].tolist()):
                state[token_id] = self._starts_stop(could_start, token_id)
            flags = state[token_ids]
        return flags > 0

    def stop_flag(self, stops: tuple[str, ...], token_id: int) -> bool:
        """stop_flags for one id."""
        state, could_start = self._stop_state(stops)
        flag = state.item(token_id)
        if flag < 0:
            flag = state[token_id] = self._starts_stop(could_start, token_id)
        return flag > 0

    def _stop_state(self, stops: tuple[str, ...]) -> tuple[np.ndarray, Callable[[str], bool]]:
        """([V] int8: 0 cannot, 1 may, -1 to be checked with could_start; could_start), per stop set."""
        entry = self._stop_states.get(stops)
        if entry is not None:
            return entry
        low, high = char_mask("".join(stop[0] for stop in stops))
        coarse = ((self.mask_low & np.uint64(low)) | (self.mask_high & np.uint64(high))) != 0
        state = coarse.astype(np.int8)
        if not high & _NON_ASCII_BIT:
            state[coarse & self.clean] = -1
        if len(self._stop_states) >= 64:
            self._stop_states.clear()
        entry = self._stop_states[stops] = (state, StopStringMatcher(stops).could_start)
        return entry

    def _starts_stop(self, could_start: Callable[[str], bool], token_id: int) -> int:
        piece = self.token_bytes.pieces[token_id]
        return int(could_start(piece[self.head[token_id]:len(piece) - self.tail[token_id]].decode("utf-8")))

    def intern(self, pending: bytes) -> int:
        """The index of these pending bytes (a start CPython holds back), added if new."""
        index = self._pending_index.get(pending)
        if index is not None:
            return index
        index = self._pending_index[pending] = len(self._pending_index)
        if index == self.pending_len.size:
            self.pending_len = np.concatenate([self.pending_len, np.zeros_like(self.pending_len)])
            self.pending_state = np.concatenate([self.pending_state, np.zeros_like(self.pending_state)])
        self.join_pieces.append(pending)
        if pending:
            lead = pending[0]
            state = int(NEED[lead]) - len(pending)
            if len(pending) == 1 and NEED[lead] >= 3:
                state |= lead << 8
            elif len(pending) >= 2 and not VALID2[lead, pending[1]]:
                state = STUCK
            self.pending_len[index] = len(pending)
            self.pending_state[index] = state
        state = int(self.pending_state[index])
        self.pending_info.append((state & 0xFF, (state >> 8) << 8, pending))
        return index

    def pending_bytes(self, index: int) -> bytes:
        return self.join_pieces[2 * self.vocab_size + index]

    def continue_pending(self, pending: int, token_id: int) -> tuple[bytes | None, int]:
        """One id after the unfinished character `pending` (an interned index), decided as
        columns.py's numpy pass decides it: (text, new pending) when the id completes the
        character and fits; (None, the longer start) when its continuation bytes only extend it;
        (None, -1) when the exact path must take the row."""
        missing, lead, data = self.pending_info[pending]
        if not VALID2_FLAT[lead | self.first_bytes[token_id]]:
            return None, -1
        if self.clean_heads[token_id] == missing:  # never for STUCK
            return data + self.trimmed_pieces[token_id], self.tail_pending_list[token_id]
        if self.head[token_id] < missing and self.continuation_len[token_id] and missing != STUCK:
            return None, self.intern(data + self.token_bytes.pieces[token_id])
        return None, -1

    def _split(self, token_id: int, piece: bytes, trimmed: list[bytes]) -> None:
        length = len(piece)
        head = 0
        while head < length and piece[head] & 0xC0 == 0x80:
            head += 1
        self.head[token_id] = head
        if head == length and length <= 2:
            self.continuation_len[token_id] = length
        if head > 3:
            return
        tail = 0
        for back in range(1, min(3, length - head) + 1):
            byte = piece[length - back]
            if byte & 0xC0 != 0x80:
                tail = back if NEED[byte] > back else 0
                break
        try:
            piece[head:length - tail].decode("utf-8")
        except UnicodeDecodeError:
            return
        if tail:
            data = piece[length - tail:]
            if not held_back(data):
                return
            self.tail_pending[token_id] = self.intern(data)
            self.tail[token_id] = tail
            trimmed[token_id] = piece[:length - tail]
        self.clean[token_id] = True


@functools.lru_cache(maxsize=8)
def token_table_for(token_bytes: TokenBytes) -> TokenTable:
    return TokenTable(token_bytes)


def decoding_with_tables(identity: common_pb2.TokenizerIdentity) -> TokenizerDecoding:
    """decoding_for_identity, with the column path's tables of a byte-level tokenizer built as
    well: a tokenizer's whole first-use cost (SmolLM2's: ~0.6 s to load, ~0.14 s of tables) is
    paid when it loads, so the gateway's warm-up RenderTokens takes all of it, not a first
    request. Cached like both parts, so later opens cost two lookups."""
    decoding = decoding_for_identity(identity)
    for token_bytes in (decoding.token_bytes or {}).values():
        token_table_for(token_bytes)
    return decoding
