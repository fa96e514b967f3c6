"""One open sequence's detok state: its incremental detokenizer, stop matcher and counts.

stream.py keeps one DetokSequence per sequence_id of a Detokenize stream and turns what
these methods return into TextDeltas.
"""

from __future__ import annotations

from collections.abc import Sequence

from detok_worker.incremental import ByteLevelDetokenizer, WindowDetokenizer
from detok_worker.render import TokenRenderer
from detok_worker.stop_strings import StopStringMatcher
from detok_worker.token_bytes import TokenBytes
from tokenwire.packing import unpack_int32_list

# The longest feed a window-detokenized sequence with stop strings takes at once (see
# DetokSequence._feed_in_pieces). Feeds are a frame's new ids, a few, except a gateway's replay of a
# whole sequence on this replica after another was lost: 4000 ids of a Llama-2-style tokenizer with
# a stop completing in them took 2.5 s in one feed, 35 ms one id a frame.
WINDOW_FEED_IDS = 256


class DetokSequence:
    __slots__ = ("sequence_id", "detokenizer", "token_bytes", "stop_matcher", "stop_search", "renderer",
                 "num_tokens", "num_reported", "finished", "stop_index", "num_tokens_to_stop", "handle", "min_tokens",
                 "unchecked_chars_owed")

    def __init__(self, sequence_id: str, detokenizer: ByteLevelDetokenizer | WindowDetokenizer,
                 stop_matcher: StopStringMatcher | None, renderer: TokenRenderer, min_tokens: int = 0) -> None:
        self.sequence_id = sequence_id
        self.detokenizer = detokenizer
        # Set for byte-level sequences: the frame loop decodes their bytes a frame at a time.
        self.token_bytes: TokenBytes | None = (
            detokenizer.token_bytes if isinstance(detokenizer, ByteLevelDetokenizer) else None
        )
        self.stop_matcher = stop_matcher
        # The matcher's could_start, None without stops: the frame loop's inline check.
        self.stop_search = stop_matcher.could_start if stop_matcher is not None else None
        self.renderer = renderer
        self.num_tokens = 0  # generated token ids consumed so far
        # Of those, the ones already counted in a TextDelta.num_tokens: a delta accounts for
        # every id consumed since the sequence's previous delta.
        self.num_reported = 0
        self.finished = False
        self.stop_index = -1
        self.num_tokens_to_stop = 0
        # OpenSequence.handle (0: none): the sequence's ids come in TokenColumns, and while it is
        # open columns.py's HandleTable holds its counts and unfinished-character bytes.
        self.handle = 0
        # OpenSequence.min_tokens: no stop ends in the text of the first this many ids.
        self.min_tokens = min_tokens
        # Characters of that text the detokenizer has not let out yet (the window detokenizer holds
        # an open byte run): the next text's first this many pass the matcher unchecked.
        self.unchecked_chars_owed = 0

    @property
    def stopped(self) -> bool:
        return self.stop_index >= 0

    def take_num_tokens(self) -> int:
        """Ids the next delta accounts for: up to the stop string once one hit."""
        end = self.num_tokens_to_stop if self.stopped else self.num_tokens
        # Below zero only when rendered deltas already counted ids past a stop completed by
        # ids held back (an open byte run); num_tokens_to_stop says where text ends then.
        count = max(0, end - self.num_reported)
        self.num_reported = max(end, self.num_reported)
        return count

    def feed(self, token_ids: Sequence[int]) -> str:
        """Text to emit for these ids (ValueError on an id not in the vocabulary)."""
        if len(token_ids) > WINDOW_FEED_IDS and self.stop_matcher is not None and self.token_bytes is None:
            return self._feed_in_pieces(token_ids)
        text = self.detokenizer.feed(token_ids)
        self.num_tokens += len(token_ids)
        if self.stop_matcher is None:
            return text
        return self.match_stops(text, token_ids, len(token_ids))

    def _feed_in_pieces(self, token_ids: Sequence[int]) -> str:
        """A long feed of a window-detokenized sequence with stops, WINDOW_FEED_IDS ids at a time:
        the text is the same however ids are split, and a stop hit's accounting
        (WindowDetokenizer.tokens_for_chars) re-decodes a window that grows from its feed's start,
        quadratic in the feed's length."""
        texts = []
        for start in range(0, len(token_ids), WINDOW_FEED_IDS):
            texts.append(self.feed(token_ids[start:start + WINDOW_FEED_IDS]))
            if self.finished:  # the rest counts as consumed, as in one feed
                self.num_tokens += max(0, len(token_ids) - start - WINDOW_FEED_IDS)
                break
        return "".join(texts)

    def finish(self) -> str:
        """Flushes held text; the sequence is finished afterwards."""
        if self.finished:
            return ""
        text = self.detokenizer.finish()
        if self.stop_matcher is not None:
            text = self.match_stops(text, (), 0)
            if not self.finished:
                text += self.stop_matcher.finish()
        self.finished = True
        return text

    def match_stops(self, text: str, token_ids: Sequence[int] | bytes, num_new_tokens: int) -> str:
        """text passed through the stop matcher; token_ids (a list or int32 LE bytes) are the
        num_new_tokens ids just fed that produced it, replayed only on a hit. The text of the first
        min_tokens ids goes through unchecked (vLLM's rule), however long the detokenizer held it."""
        matcher = self.stop_matcher
        assert matcher is not None
        tokens_before = self.num_tokens - num_new_tokens
        ids: Sequence[int] | None = None
        if not num_new_tokens and self.num_tokens <= self.min_tokens:
            return matcher.push_unchecked(text)  # the finish of an output no longer than min_tokens
        if self.min_tokens > tokens_before:  # some ids of this feed are among the first min_tokens
            ids = unpack_int32_list(token_ids) if isinstance(token_ids, bytes) else token_ids
            unchecked_ids = min(self.min_tokens - tokens_before, num_new_tokens)
            # Their characters since the last text out (a held byte run's included).
            chars = self.detokenizer.chars_for_tokens(ids, unchecked_ids)
            if unchecked_ids == num_new_tokens:
                self.unchecked_chars_owed = max(0, chars - len(text))
                return matcher.push_unchecked(text)
            self.unchecked_chars_owed = chars
        split = min(self.unchecked_chars_owed, len(text))
        head = ""
        if split:
            self.unchecked_chars_owed -= split
            head, text = matcher.push_unchecked(text[:split]), text[split:]
            if not text:
                return head
        emit, stop_index, chars_to_stop = matcher.push(text)
        if stop_index >= 0:
            # Only now map characters back to tokens: a replay of this step's few ids.
            if ids is None:
                ids = unpack_int32_list(token_ids) if isinstance(token_ids, bytes) else token_ids
            self.num_tokens_to_stop = tokens_before + self.detokenizer.tokens_for_chars(ids, split + chars_to_stop)
            self.stop_index = stop_index
            self.finished = True
        return head + emit
