"""Stop strings: StopStringMatcher on its own, and DetokSequence's token accounting.

Pure tests of stop_strings.py and sequence.py against simple one-shot references.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from detok_worker.incremental import new_detokenizer
from detok_worker.render import renderer_for
from detok_worker.sequence import DetokSequence
from detok_worker.stop_strings import StopStringMatcher
from detok_worker.token_bytes import TokenizerDecoding


def reference_stop(text: str, stops: Sequence[str]) -> tuple[int, int, int]:
    """(stop index, start, end) of the match that ends first (ties: longer, then lower
    index), or (-1, len, len): the full text cut at the earliest stop, spelled out."""
    order = sorted(range(len(stops)), key=lambda i: (-len(stops[i]), i))
    for end in range(1, len(text) + 1):
        for index in order:
            if text.endswith(stops[index], 0, end):
                return index, end - len(stops[index]), end
    return -1, len(text), len(text)


def run_matcher(matcher: StopStringMatcher, pieces: Sequence[str]) -> tuple[str, int, int]:
    """(all emitted text, stop index, characters pushed up to the stop's end)."""
    emitted = []
    pushed = 0
    for piece in pieces:
        text, stop_index, chars_to_stop = matcher.push(piece)
        emitted.append(text)
        if stop_index >= 0:
            return "".join(emitted), stop_index, pushed + chars_to_stop
        pushed += len(piece)
    emitted.append(matcher.finish())
    return "".join(emitted), -1, pushed


def test_stop_split_across_many_deltas() -> None:
    matcher = StopStringMatcher(["<|STOP|>"])
    outputs = [matcher.push(c) for c in "Hello <|STOP|> never"]
    assert "".join(text for text, _, _ in outputs) == "Hello "
    assert [i for i, (_, stop, _) in enumerate(outputs) if stop >= 0] == [13]
    assert outputs[13] == ("", 0, 1)
    assert matcher.push("more") == ("", -1, 0)
    assert matcher.finish() == ""


def test_earliest_completed_stop_wins() -> None:
    assert run_matcher(StopStringMatcher(["world", "lo"]), ["Hello world"]) == ("Hel", 1, 5)
    # "b" completes before "abc" could: the stream cannot wait for a later "c".
    assert run_matcher(StopStringMatcher(["abc", "b"]), ["xa", "bc"]) == ("xa", 1, 3)
    # Same end: the longer stop (it starts earlier) wins, whatever the list order.
    assert run_matcher(StopStringMatcher(["bc", "abc"]), ["xab", "cz"]) == ("x", 1, 4)
    assert run_matcher(StopStringMatcher(["abc", "bc"]), ["xabcz"]) == ("x", 0, 4)
    # Equal strings: the lower index.
    assert run_matcher(StopStringMatcher(["q", "q"]), ["aqa"]) == ("a", 0, 2)


def test_text_after_the_stop_is_never_emitted() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.push("abENDcd") == ("ab", 0, 5)
    assert matcher.push("ef") == ("", -1, 0)
    assert matcher.finish() == ""


def test_hold_back_released_when_not_a_stop() -> None:
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.push("a ST") == ("a ", -1, 0)
    assert matcher.held_text == "ST"
    assert matcher.push("A") == ("STA", -1, 0)
    assert matcher.push("RT\n") == ("RT", -1, 0)
    assert matcher.held_text == "\n"
    assert matcher.push("x") == ("\nx", -1, 0)
    assert matcher.push("STO") == ("", -1, 0)
    assert matcher.finish() == "STO"


def test_holds_only_the_longest_possible_stop_start() -> None:
    matcher = StopStringMatcher(["abab", "zz"])
    assert matcher.push("xxabab"[:5]) == ("xx", -1, 0)  # "aba" could still be "abab"
    assert matcher.held_text == "aba"
    assert matcher.push("a") == ("aba", -1, 0)  # "abaa": only the last "a" can still start one
    assert matcher.held_text == "a"


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert matcher.push("Hello ST") == ("Hello ", -1, 0)
    assert matcher.push("OP and more") == ("STOP", 0, 2)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stop string 1 is empty"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(ValueError):
        StopStringMatcher([])


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=12),
    include=st.booleans(),
)
def test_matches_one_shot_reference(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopStringMatcher(stops, include)
    emitted = ""
    pushed = ""
    for piece in pieces:
        out, stop_index, chars_to_stop = matcher.push(piece)
        emitted += out
        if stop_index >= 0:
            break
        pushed += piece
        # Held back: exactly the longest suffix that is a proper prefix of some stop.
        expected_hold = next((pushed[i:] for i in range(len(pushed))
                              if any(s.startswith(pushed[i:]) and s != pushed[i:] for s in stops)), "")
        assert matcher.held_text == expected_hold
        assert emitted + matcher.held_text == pushed
    else:
        emitted += matcher.finish()
        stop_index = -1
    ref_index, ref_start, ref_end = reference_stop(text, stops)
    assert stop_index == ref_index
    assert emitted == text[:ref_end if include else ref_start]
    if stop_index >= 0:
        assert len(pushed) + chars_to_stop == ref_end


# --- DetokSequence: which token completed the stop ---

def first_tokens_reaching_stop(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> int:
    for count in range(1, len(ids) + 1):
        if reference_stop(tokenizer.decode(ids[:count]), stops)[0] >= 0:
            return count
    return 0


TEXT = "The café serves crème brûlée 🍮. Observation: tasty!\n\nUser: more please"


@pytest.mark.parametrize("stops", [["Observation:"], ["\n\n", "brûlée 🍮"], ["🍮"], ["serves", "ser"], ["é"]])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_sequence_counts_tokens_to_stop(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding,
                                        stops: list[str], chunk: int) -> None:
    ids = smollm2.encode(TEXT).ids
    sequence = DetokSequence("s", new_detokenizer(smollm2_decoding, True), StopStringMatcher(stops),
                             renderer_for(smollm2_decoding))
    emitted = ""
    for start in range(0, len(ids), chunk):
        emitted += sequence.feed(ids[start:start + chunk])
        if sequence.finished:
            break
    index, start_char, _ = reference_stop(TEXT, stops)
    assert sequence.stopped and sequence.stop_index == index
    assert emitted == TEXT[:start_char]
    assert sequence.num_tokens_to_stop == first_tokens_reaching_stop(smollm2, ids, stops)


def test_sequence_finish_flushes_held_text(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding) -> None:
    ids = smollm2.encode("It ends with Obs").ids
    sequence = DetokSequence("s", new_detokenizer(smollm2_decoding, True), StopStringMatcher(["Observation:"]),
                             renderer_for(smollm2_decoding))
    emitted = "".join(sequence.feed([i]) for i in ids)
    assert emitted == "It ends with "
    assert sequence.finish() == "Obs"
    assert sequence.finished and not sequence.stopped and sequence.num_tokens == len(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sequence_against_reference(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding,
                                    data: st.DataObject) -> None:
    text = data.draw(st.sampled_from([TEXT, "Grüße 👋🏽 aus München! Ende.", "a\n\nb\n\nc"]))
    ids = smollm2.encode(text).ids
    stops = data.draw(st.lists(st.builds(lambda a, n: text[a:a + n], st.integers(0, len(text) - 1),
                                         st.integers(1, 6)), min_size=1, max_size=3))
    include = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    sequence = DetokSequence("s", new_detokenizer(smollm2_decoding, True), StopStringMatcher(stops, include),
                             renderer_for(smollm2_decoding))
    emitted = ""
    start = 0
    for size in [*chunks, len(ids)]:
        emitted += sequence.feed(ids[start:start + size])
        start += size
        if sequence.finished or start >= len(ids):
            break
    if not sequence.finished:
        emitted += sequence.finish()
    index, start_char, end_char = reference_stop(text, stops)
    assert sequence.stop_index == index
    assert emitted == text[:end_char if include else start_char]
    if index >= 0:
        assert sequence.num_tokens_to_stop == first_tokens_reaching_stop(smollm2, ids, stops)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc\n<", max_size=12),
    stops=st.lists(st.text(alphabet="abc\n<", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_could_start_never_misses_work_for_push(text: str, stops: list[str]) -> None:
    """The frame loop skips push() for text could_start finds nothing in (nothing held): then
    push would have returned the text unchanged, with no hit and nothing held."""
    matcher = StopStringMatcher(stops)
    pushed = matcher.push(text)
    if not StopStringMatcher(stops).could_start(text):
        assert pushed == (text, -1, 0)
        assert matcher.held_text == ""
    # Not vacuous: some cases skip push, some need it.
    assert StopStringMatcher(["\n\nX"]).could_start("a\nb") is False
    assert StopStringMatcher(["\n\nX"]).could_start("a\n") is True


def test_a_long_feed_with_a_stop_in_it_reads_as_one_id_a_frame_and_decodes_linearly(tmp_path, monkeypatch) -> None:
    """A gateway replays a whole sequence in one entry on a replica when another was lost. On a
    window-detokenized tokenizer (SentencePiece with byte fallback: Llama 2, Mistral) a stop hit's
    accounting re-decoded a window from the feed's start, id by id: 4000 ids took 2.5 s, while
    the replica answered no other stream. Fed in pieces: the same text, stop and counts."""
    from detok_worker.incremental import WindowDetokenizer
    from detok_worker.sequence import WINDOW_FEED_IDS
    from detok_worker.stream import DetokenizeStream
    from tests.detok_tokenizers import llama2_style
    from tokenwire.packing import pack_int32
    from tokenwire.tokenizer_files import tokenizer_identity
    from tokenwire.v1 import detok_worker_pb2 as pb

    tokenizer = llama2_style()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    identity = tokenizer_identity(tmp_path)
    sentence = tokenizer.encode("The quick brown fox jumps over the lazy dog. Hello there. ").ids
    ids = (sentence * (4000 // len(sentence) + 1))[:4000] + tokenizer.encode(" STOPHERE and more").ids

    decoded = [0]  # ids passed to the tokenizer's decode
    real_decode = WindowDetokenizer._decode

    def counted_decode(self, window: list[int]) -> str:
        decoded[0] += len(window)
        return real_decode(self, window)

    monkeypatch.setattr(WindowDetokenizer, "_decode", counted_decode)

    def run(ids_per_frame: int) -> tuple[str, tuple[int, int, int], int]:
        decoded[0] = 0
        stream = DetokenizeStream()
        stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="s", tokenizer=identity, stop=["STOPHERE"],
                                                               skip_special_tokens=True, prompt_tail_ids=[5])]))
        assert isinstance(stream._live["s"].detokenizer, WindowDetokenizer)
        text, ended = "", None
        for start in range(0, len(ids), ids_per_frame):
            reply = stream.apply(pb.DetokenizeFrame(tokens=[pb.SequenceTokenIds(
                sequence_id="s", token_ids=pack_int32(ids[start:start + ids_per_frame]))]))
            text += "".join(delta.text for delta in reply.deltas)
            ended = next(((d.stop_index, d.num_tokens_to_stop, d.num_tokens) for d in reply.deltas if d.finished),
                         ended)
            if ended is not None:
                break
        return text, ended, decoded[0]

    one_a_frame, ended, _ = run(1)
    at_once, ended_at_once, decoded_at_once = run(len(ids))
    assert at_once == one_a_frame and ended_at_once[:2] == ended[:2], (ended_at_once, ended)
    assert ended[0] == 0 and 4000 < ended[1] < len(ids), ended  # the stop's index, and the ids up to it
    assert len(one_a_frame) > 15000 and "STOPHERE" not in one_a_frame
    # Linear in the feed, not quadratic: 8.05 million ids decoded before (2.1 s, against 0.03 s one
    # id a frame), 70 thousand now (0.03 s)
    assert decoded_at_once <= 2 * WINDOW_FEED_IDS * len(ids), decoded_at_once


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=6), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=12),
    include=st.booleans(),
)
def test_long_stop_sets_test_prefixes_without_holding_them_and_match_the_same(
        text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    from detok_worker import stop_strings

    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def run() -> list[tuple[str, int, int, str]]:
        stop_strings._stop_set_tables.cache_clear()
        matcher = StopStringMatcher(stops, include)
        steps = [(matcher.push_unchecked(pieces[0]), -1, 0, matcher.held_text)] if pieces else []
        return steps + [(*matcher.push(piece), matcher.held_text) for piece in pieces[1:]]

    held_as_sets = run()
    limit = stop_strings.PREFIX_SET_MAX_CHARS
    stop_strings.PREFIX_SET_MAX_CHARS = 0  # every set tests by startswith
    try:
        assert run() == held_as_sets
    finally:
        stop_strings.PREFIX_SET_MAX_CHARS = limit
        stop_strings._stop_set_tables.cache_clear()


def test_a_stop_set_of_long_stops_costs_no_memory_for_its_prefixes() -> None:
    # 16 stops of 512 characters: every proper prefix held was 2.1 M characters, 3-9 MB a set, and
    # 128 requests with sets of their own took a detok replica from 132 to 740 MB (review 96).
    import tracemalloc

    sets = [[f"{n:03d}{k:02d}" + "🦙" * 507 for k in range(16)] for n in range(8)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        matchers = [StopStringMatcher(stops) for stops in sets]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 2 << 20, grown  # the stops themselves: 8 x 16 x 512 x 4 bytes = 256 KiB
    text = "x" + sets[3][5][:300]
    out, index, _ = matchers[3].push(text)
    assert (out, index, matchers[3].held_text) == ("x", -1, sets[3][5][:300])
    assert matchers[3].push(sets[3][5][300:] + "tail") == ("", 5, 512 - 300)


def test_a_stop_after_a_long_run_of_skipped_ids_is_accounted_without_decoding_them(tmp_path, monkeypatch) -> None:
    # A window-detokenized tokenizer holds every id since the last text: 10,000 skipped specials (a
    # degenerate <unk> run) were decoded one more at a time when a stop then completed, 2 s of one
    # frame (review 96). They decode to nothing: the same count, from the window without them.
    from detok_worker.incremental import WindowDetokenizer
    from detok_worker.stream import DetokenizeStream
    from tests.detok_tokenizers import llama2_style
    from tokenwire.packing import pack_int32
    from tokenwire.tokenizer_files import tokenizer_identity
    from tokenwire.v1 import detok_worker_pb2 as pb

    tokenizer = llama2_style()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    identity = tokenizer_identity(tmp_path)
    unk, run = tokenizer.token_to_id("<unk>"), 2000
    fox = tokenizer.encode("The quick brown fox", add_special_tokens=False).ids
    decoded = [0]
    real_decode = WindowDetokenizer._decode

    def counted_decode(self, window: list[int]) -> str:
        decoded[0] += len(window)
        return real_decode(self, window)

    monkeypatch.setattr(WindowDetokenizer, "_decode", counted_decode)
    stream = DetokenizeStream()
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="s", tokenizer=identity, stop=["fox"],
                                                           skip_special_tokens=True,
                                                           prompt_tail_ids=tokenizer.encode("Hello there").ids)]))
    for _ in range(run // 100):
        stream.apply(pb.DetokenizeFrame(tokens=[pb.SequenceTokenIds(sequence_id="s", token_ids=pack_int32([unk] * 100))]))
    decoded[0] = 0
    (delta,) = stream.apply(pb.DetokenizeFrame(tokens=[pb.SequenceTokenIds(sequence_id="s",
                                                                             token_ids=pack_int32(fox))])).deltas
    assert (delta.text, delta.finished, delta.stop_index) == (" The quick brown ", True, 0)
    assert delta.num_tokens_to_stop == run + len(fox)  # "fox" is the last id
    assert decoded[0] < 10 * run, decoded[0]  # one decode of the held window, not one per held id
