"""Incremental detokenizers for one sequence: token ids in, new whole-character text out.

Second step of the detok flow, between token_bytes.py (ids -> bytes) and the stop-string
matcher; sequence.py owns one of these per open sequence.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from detok_worker.token_bytes import TokenBytes, TokenizerDecoding

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer(Protocol):
    def feed(self, token_ids: Sequence[int]) -> str:
        """Text completed by these ids; raises ValueError on an id not in the vocabulary."""
        ...

    def finish(self) -> str:
        """Whatever is still held back, less a character the output ended inside (dropped, as vLLM's
        detokenizers never emit it)."""
        ...

    def tokens_for_chars(self, token_ids: Sequence[int], num_chars: int) -> int:
        """How many of the last feed's ids it took for that feed's text to reach num_chars
        characters (stop accounting); len(token_ids) if it never did, 0 or less if ids held
        back from earlier feeds already did."""
        ...

    def chars_for_tokens(self, token_ids: Sequence[int], num_tokens: int) -> int:
        """How many characters of the last feed's text its first num_tokens ids (token_ids) made:
        where min_tokens' unchecked text ends inside a feed."""
        ...


class ByteLevelDetokenizer:
    """Byte-level BPE: bytes are context-free, so text is the UTF-8 decoding of the
    concatenated token bytes and the prompt never matters."""

    __slots__ = ("token_bytes", "pending", "pending_before_feed")

    def __init__(self, token_bytes: TokenBytes) -> None:
        self.token_bytes = token_bytes
        # The start of a character whose remaining bytes are still to come. Public, with
        # pending_before_feed, because stream.py's frame loop does feed_bytes' work inline.
        self.pending = b""
        self.pending_before_feed = b""

    def feed(self, token_ids: Sequence[int]) -> str:
        ids = np.asarray(token_ids, dtype=np.int64)
        self.token_bytes.check_ids(ids)
        return self.feed_bytes(self.token_bytes.decode(ids))

    def feed_bytes(self, chunk: bytes) -> str:
        """The frame loop's entry: chunk is this sequence's slice of the frame's bytes."""
        # This is codecs.getincrementaldecoder("utf-8")(errors="replace").decode inlined: same
        # function, same buffering, so the deltas concatenate to bytes.decode("utf-8",
        # "replace"), which is Rust's String::from_utf8_lossy that tokenizers' decode uses.
        # Inlined to keep the pending bytes at hand for tokens_for_chars (and save a call).
        self.pending_before_feed = self.pending
        data = self.pending + chunk
        text, consumed = codecs.utf_8_decode(data, "replace", False)
        self.pending = data[consumed:]
        return text

    def finish(self) -> str:
        """Nothing: the start of a character the output ended inside is dropped, as vLLM's and
        TGI's detokenizers never emit it (tokenizers' decode would end in U+FFFD)."""
        self.pending_before_feed = self.pending
        self.pending = b""
        return ""

    def chars_for_tokens(self, token_ids: Sequence[int], num_tokens: int) -> int:
        pieces = self.token_bytes.pieces
        data = self.pending_before_feed + b"".join(pieces[token_id] for token_id in token_ids[:num_tokens])
        return len(codecs.utf_8_decode(data, "replace", False)[0])

    def tokens_for_chars(self, token_ids: Sequence[int], num_chars: int) -> int:
        pieces = self.token_bytes.pieces
        pending = self.pending_before_feed
        produced = 0
        for count, token_id in enumerate(token_ids, start=1):
            data = pending + pieces[token_id]
            text, consumed = codecs.utf_8_decode(data, "replace", False)
            pending = data[consumed:]
            produced += len(text)
            if produced >= num_chars:
                return count
        return len(token_ids)


class WindowDetokenizer:
    """Any other tokenizer: re-decode a short window of ids and emit what it adds past the
    window's already-emitted prefix (vLLM's prefix/read offsets). Decoders such as
    Metaspace strip the space of the first token they see, so the window always starts one
    step back (or in the prompt tail) to decode the next piece with its leading space."""

    __slots__ = ("_tokenizer", "_vocab_size", "_skip_special_tokens", "_byte_fallback_ids", "_byte_fallback_bytes",
                 "_context_id", "_skipped_ids",
                 "_ids", "_read_offset", "_prefix_text", "_window_before_feed", "_window_len_before_feed",
                 "_read_offset_before_feed", "_prefix_text_before_feed")

    def __init__(self, decoding: TokenizerDecoding, skip_special_tokens: bool,
                 prompt_tail_ids: Sequence[int] = ()) -> None:
        self._tokenizer = decoding.tokenizer
        self._vocab_size = decoding.vocab_size
        self._skip_special_tokens = skip_special_tokens
        self._byte_fallback_ids = decoding.byte_fallback_ids
        self._byte_fallback_bytes = decoding.byte_fallback_bytes
        self._context_id = decoding.context_id
        # Skipped special tokens never reach the decoder, so they do not end a byte run.
        self._skipped_ids: frozenset[int] = decoding.special_ids if skip_special_tokens else frozenset()
        self._check(prompt_tail_ids)
        # _ids[:_read_offset] is the window prefix already emitted (or prompt); the rest is
        # held because its text still ends in an unfinished character.
        self._ids: list[int] = self._without_open_byte_run(list(prompt_tail_ids))
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        # The window before the last feed is _window_before_feed[:_window_len_before_feed]: feed
        # only appends to _ids and emitting starts a new list, so no copy per feed is needed.
        self._window_before_feed: list[int] = []
        self._window_len_before_feed = 0
        self._read_offset_before_feed = 0
        self._prefix_text_before_feed = ""

    def _without_open_byte_run(self, tail: list[int]) -> list[int]:
        """The prompt tail less the byte-fallback run it ends in, where that run ends inside a
        character. Its bytes are the prompt's: counted as emitted text they would be one U+FFFD
        each, and the character the output completes only one, so the output's first characters
        went missing. Without them the output decodes as its own ids do (a continuation byte
        alone is U+FFFD), as on the byte-level path."""
        if not self._byte_fallback_ids or not self._decode(tail).endswith(REPLACEMENT_CHAR):
            return tail
        end = len(tail)
        while end and (tail[end - 1] in self._byte_fallback_ids or tail[end - 1] in self._skipped_ids):
            end -= 1
        if end == 0 and self._context_id is not None:
            # Nothing of the tail is left, yet the output does not start the text: a plain letter
            # keeps its first space where decode(prompt + output) has it.
            return [self._context_id]
        return tail[:end]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _check(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(f"token id {token_id} is not in the tokenizer's vocabulary (size {self._vocab_size})")

    def feed(self, token_ids: Sequence[int]) -> str:
        self._check(token_ids)
        self._remember_window()
        self._ids.extend(token_ids)
        # ByteFallback decodes a run of <0xNN> pieces as a whole: one invalid byte later in the
        # run turns every byte of it into U+FFFD, even a character already complete, so nothing
        # of an open run is final before it ends. Checked before the decode, which it would
        # throw away: a decode of the growing window per byte made a long run quadratic.
        if self._in_byte_run():
            return ""
        text = self._decode(self._ids)
        # A trailing U+FFFD is most likely a character whose bytes are still to come; hold it
        # rather than emit a replacement char.
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = text[len(self._prefix_text):]
        # The ids just emitted become the next window's prefix; a new list, since the old one
        # still holds the window before this feed.
        self._ids = self._ids[self._read_offset:]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _open_run_cut(self, text: str) -> str:
        """The window's text where it ends in a byte-fallback run cut inside a character: the
        text before the run, then the run's bytes with the unfinished character left out.
        ByteFallback turns every byte of a run that is not whole UTF-8 into U+FFFD, the run's
        complete characters too ('ok 👍' plus a lead byte decoded 'ok �����'), where vLLM's
        detokenizer has emitted 👍 already. Other windows, and a run with an invalid byte (whose
        text is ByteFallback's U+FFFDs, which vLLM holds back as well): text as it is."""
        start = len(self._ids)
        while start and (self._ids[start - 1] in self._byte_fallback_ids or self._ids[start - 1] in self._skipped_ids):
            start -= 1
        run = [self._byte_fallback_bytes[t] for t in self._ids[start:] if t in self._byte_fallback_bytes]
        try:
            run_text = codecs.utf_8_decode(bytes(run), "strict", False)[0] if run else None
        except UnicodeDecodeError:
            run_text = None
        return text if run_text is None else self._decode(self._ids[:start]) + run_text

    def _in_byte_run(self) -> bool:
        if not self._byte_fallback_ids:
            return False
        for token_id in reversed(self._ids):
            if token_id not in self._skipped_ids:
                return token_id in self._byte_fallback_ids
        return False

    def _remember_window(self) -> None:
        self._window_before_feed = self._ids
        self._window_len_before_feed = len(self._ids)
        self._read_offset_before_feed = self._read_offset
        self._prefix_text_before_feed = self._prefix_text

    def finish(self) -> str:
        """The held text, less a character the output ended inside, which vLLM's and TGI's
        detokenizers never emit either (nor any trailing U+FFFD: they hold text that ends in one)."""
        self._remember_window()
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT_CHAR):
            text = self._open_run_cut(text).rstrip(REPLACEMENT_CHAR)
        delta = text[len(self._prefix_text):]
        self._ids = []
        self._read_offset = 0
        self._prefix_text = ""
        return delta

    def chars_for_tokens(self, token_ids: Sequence[int], num_tokens: int) -> int:
        window = self._window_before_feed[:self._window_len_before_feed] + list(token_ids[:num_tokens])
        # As feed: a character whose bytes are still to come is not text yet.
        text = self._decode(window).rstrip(REPLACEMENT_CHAR)
        return max(0, len(text) - len(self._prefix_text_before_feed))

    def tokens_for_chars(self, token_ids: Sequence[int], num_chars: int) -> int:
        """Counted from the first id of the last feed; 0 or less when ids held back from
        earlier feeds (an open byte run) already completed the characters."""
        # The replay does not hold back for an open byte run: the stop's characters first
        # appear in decode(ids) at the piece that completes them, which is the count wanted.
        prefix = self._window_before_feed[:self._read_offset_before_feed]
        held = self._window_before_feed[self._read_offset_before_feed:self._window_len_before_feed]
        prefix_len = len(self._prefix_text_before_feed)
        window = list(prefix)
        skipped = self._skipped_ids
        for count, token_id in enumerate([*held, *token_ids], start=1 - len(held)):
            if token_id in skipped:
                # Decodes to nothing: the text, and the answer, as for the id before. Decoded,
                # a run of 10,000 of them held before a stop took 2 s of one frame (review 96).
                continue
            window.append(token_id)
            text = self._decode(window)
            if not text.endswith(REPLACEMENT_CHAR) and len(text) - prefix_len >= num_chars:
                return count
        return len(token_ids)


def new_detokenizer(decoding: TokenizerDecoding, skip_special_tokens: bool,
                    prompt_tail_ids: Sequence[int] = ()) -> ByteLevelDetokenizer | WindowDetokenizer:
    if decoding.token_bytes is not None:
        return ByteLevelDetokenizer(decoding.token_bytes[skip_special_tokens])
    return WindowDetokenizer(decoding, skip_special_tokens, prompt_tail_ids)
