"""Stop-string matching over a stream of text deltas, across any delta boundaries.

Third step of the detok flow: sequence.py passes each delta from the incremental
detokenizer through a StopStringMatcher before it goes out in a TextDelta.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Container, Sequence

# (text safe to emit, index of the stop string hit or -1, characters of the pushed text up
# to and including the stop's last one, 0 when no hit). A plain tuple: it is built once per
# sequence per frame.
StopCheck = tuple[str, int, int]


# Past this many characters in all of a set's proper prefixes, a set tests prefixes with
# startswith (_PrefixesOf) instead of holding each one: 16 stops of 512 characters made 2.1 M
# characters of prefixes, 3-9 MB a set, and 128 requests with sets of their own took a detok replica
# from 132 to 740 MB (review 96). Below it (a 180-character stop) a set lookup stays the cheaper test.
PREFIX_SET_MAX_CHARS = 1 << 14


class _PrefixesOf:
    """`text in` it: text starts some stop (proper: and is shorter than it), by startswith."""

    __slots__ = ("stops", "proper")

    def __init__(self, stops: tuple[str, ...], proper: bool) -> None:
        self.stops = stops
        self.proper = proper

    def __contains__(self, text: str) -> bool:
        size = len(text) + self.proper
        return any(len(stop) >= size and stop.startswith(text) for stop in self.stops)


@functools.lru_cache(maxsize=256)
def _stop_set_tables(stops: tuple[str, ...]) -> tuple[int, int, Container[str], Container[str], re.Pattern[str],
                                                     tuple[str, ...], str]:
    """What a matcher looks up for a stop set, built once per set: a sequence is opened per
    request, and with many streams this was half of the detok worker's cost of an open.
    (longest hold, shortest stop, proper prefixes, prefixes and stops, first-character regex,
    first two characters of each, first characters.)"""
    prefixes: Container[str]
    prefixes_or_stops: Container[str]
    if sum(len(stop) * (len(stop) - 1) // 2 for stop in stops) <= PREFIX_SET_MAX_CHARS:
        prefixes = frozenset(stop[:end] for stop in stops for end in range(1, len(stop)))
        prefixes_or_stops = prefixes | frozenset(stops)
    else:
        prefixes, prefixes_or_stops = _PrefixesOf(stops, proper=True), _PrefixesOf(stops, proper=False)
    return (max(map(len, stops)) - 1, min(map(len, stops)), prefixes, prefixes_or_stops,
            re.compile("[" + "".join(sorted({re.escape(stop[0]) for stop in stops})) + "]"),
            tuple(sorted({stop[:2] for stop in stops})),  # first two chars (or one)
            "".join({stop[0] for stop in stops}))


class StopStringMatcher:
    """Finds the first stop string to complete in the text pushed so far.

    "First" means the match that ends earliest in the stream: the model worker is aborted as
    soon as any stop string has appeared, so we can never wait for later tokens to see
    whether a stop that started earlier will complete too. Ties (two matches ending at the
    same character, i.e. one is a suffix of the other) go to the longer stop string, which
    cuts the text earlier; then to the lower index in the list (equal strings).
    """

    __slots__ = ("stops", "include_stop_str_in_output", "held_text", "_max_hold", "_prefixes",
                 "_first_chars", "_starts", "_first_char_set", "_done", "_prefixes_or_stops",
                 "_shortest", "_unchecked")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if not stops:
            raise ValueError("StopStringMatcher needs at least one stop string")
        for index, stop in enumerate(stops):
            if not stop:
                raise ValueError(f"stop string {index} is empty; an empty stop would end every text at once")
        self.stops = list(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        # Text that could be the start of a stop string: held until the next push shows
        # whether the stop completes (then it must not be emitted) or not (then it is).
        self.held_text = ""
        (self._max_hold, self._shortest, self._prefixes, self._prefixes_or_stops, self._first_chars, self._starts,
         self._first_char_set) = _stop_set_tables(tuple(stops))
        self._done = False
        # Characters at the start of held_text that push_unchecked let by: no stop ends in them.
        self._unchecked = 0

    def could_start(self, text: str) -> bool:
        """Whether a stop could start in this new text: it holds one's first two chars, or
        ends with one's first char. With nothing held, text where it could not can neither
        hold a stop nor end in the start of one, so push() would hand it back unchanged; the
        frame loop checks this inline and skips that call (a lone "\\n" does not wake
        "\\n\\nObservation:"). Plain `in` tests: cheaper here than one regex search."""
        for start in self._starts:
            if start in text:
                return True
        return text[-1] in self._first_char_set if text else False

    def push(self, text: str) -> StopCheck:
        if self._done:
            return "", -1, 0
        held = self.held_text
        unchecked, self._unchecked = self._unchecked, 0
        if held and text and self._first_chars.search(text) is None and not self._continued(held, text[0]):
            # Held text that text's first character ends as a possible stop start: a hit or a
            # new hold could only start in held (text starts none), so all of it goes out.
            self.held_text = ""
            return held + text, -1, 0
        buf = held + text if held else text
        # Most deltas hold no char that starts a stop string: then nothing can match or be
        # held, and one regex scan decides it.
        first = self._first_chars.search(buf)
        if first is None:
            self.held_text = ""
            return buf, -1, 0
        if first.start() == len(buf) - 1 and self._shortest > 1:
            # Only the last character may start a stop, and no stop is that short: no hit, and
            # that character is the hold (a "\n" ending a delta, with "\n\nObservation:").
            # (One character holds no stop here, so none can end in it: nothing stays unchecked.)
            self.held_text = buf[-1]
            return buf[:-1], -1, 0
        best_end = -1
        best_index = -1
        best_len = 0
        search_from = first.start()
        for index, stop in enumerate(self.stops):
            # held holds no whole stop (the last push would have found it), so this stop's
            # first occurrence is also where it ends earliest; only unchecked held text may hold
            # one, and a stop that ends in it is none.
            start = buf.find(stop, max(search_from, unchecked - len(stop) + 1) if unchecked else search_from)
            if start < 0:
                continue
            end = start + len(stop)
            if best_index < 0 or end < best_end or (end == best_end and len(stop) > best_len):
                best_end, best_index, best_len = end, index, len(stop)
        if best_index >= 0:
            self._done = True
            self.held_text = ""
            cut = best_end if self.include_stop_str_in_output else best_end - best_len
            return buf[:cut], best_index, best_end - len(held)
        hold_from = self._hold_from(buf)
        self.held_text = buf[hold_from:]
        self._unchecked = max(0, unchecked - hold_from)  # unchecked text still held stays so
        return buf[:hold_from], -1, 0

    def push_unchecked(self, text: str) -> str:
        """Text in which no stop may end (the first min_tokens ids' text): passed through, but
        its tail that could start a stop stays held, so a stop that ends in later text is found
        from its start (vLLM's rule: a stop may start in that text; one ending in it is none)."""
        if self._done:
            return ""
        buf = self.held_text + text
        self.held_text = buf[self._hold_from(buf):]
        self._unchecked = len(self.held_text)
        return buf[:len(buf) - len(self.held_text)]

    def _continued(self, held: str, char: str) -> bool:
        """Whether some suffix of held, then char, is the start of a stop string (or one)."""
        starts = self._prefixes_or_stops
        for start in range(len(held)):  # a loop, not any(): a generator costs more for a 1-char hold
            if held[start:] + char in starts:
                return True
        return False

    def _hold_from(self, buf: str) -> int:
        """Start of the longest suffix of buf that is a proper prefix of some stop string."""
        if self._max_hold == 0:
            return len(buf)
        match = self._first_chars.search(buf, max(0, len(buf) - self._max_hold))
        while match is not None:
            start = match.start()
            if buf[start:] in self._prefixes:
                return start
            match = self._first_chars.search(buf, start + 1)
        return len(buf)

    def finish(self) -> str:
        """The held text: no more text is coming, so it cannot become a stop."""
        held, self.held_text = self.held_text, ""
        self._done = True
        return held
