"""The column path's one-id row loop (HandleTable._decode_one_id_rows) against the numpy pass and the
message path.

Frames of one id per row are what a decode step sends; the loop must decide, answer and leave
state exactly as the numpy pass does (HandleTable.one_id_loop=False), and both as the message path.
"""

from __future__ import annotations

import codecs
import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from detok_worker.columns import _LIVE, FEW_ROWS, HandleTable
from detok_worker.stop_strings import StopStringMatcher
from detok_worker.stream import BadFrameError, DetokenizeStream
from detok_worker.token_bytes import TokenizerDecoding
from detok_worker.token_table import STUCK, VALID2, token_table_for
from tests import test_detok_columns
from tests.detok_tokenizers import finished_text
from tests.test_detok_columns import SETTINGS, Plan, VocabInfo, answers_of, identity, plans, run_lockstep
from tests.test_detok_stop_strings import reference_stop
from tokenwire.packing import pack_int32
from tokenwire.v1 import detok_worker_pb2 as pb

# The column tests' fixtures: SmolLM2, cl100k and a SentencePiece-style tokenizer, and their sample ids.
decodings = test_detok_columns.decodings
vocab_info = test_detok_columns.vocab_info

# Stops these texts hit, often across ids: ASCII, a split 2-byte char, CJK, an emoji.
STOPS = [["\n"], ["é"], ["日本", " the"], ["🙂", "ß"], ["x**", "Всё"], [], ["quick", "ö"]]


def test_one_id_frames_match_the_message_path(decodings: dict[str, TokenizerDecoding],
                                              vocab_info: VocabInfo) -> None:
    """Random sequences (split characters, specials, out-of-vocabulary ids, stops, late ids,
    reused handles), one id per row per frame."""
    one_each = plans(vocab_info).map(lambda ps: [dataclasses.replace(p, chunks=[1] * len(p.ids)) for p in ps])

    @SETTINGS
    @given(plans_=one_each, delay=st.integers(0, 2))
    def check(plans_: list[Plan], delay: int) -> None:
        run_lockstep(decodings, plans_, delay)

    check()


def run_loop_and_numpy_pass(decodings: dict[str, TokenizerDecoding], sequences: list[tuple[str, list[int]]],
                            rng: np.random.Generator, few_rows_lane_only: bool = False) -> int:
    """Feeds the same one-id column frames to a stream with the loop and one with the numpy
    pass; after every frame their answers and every live handle's state must be equal.
    few_rows_lane_only: the second stream runs the loop too, and only the first takes the lane
    of a few plain rows. Returns how many sequences a stop ended."""
    streams = [DetokenizeStream(lambda ident: decodings[ident.path]) for _ in range(2)]
    streams[1]._columns.one_id_loop = few_rows_lane_only
    streams[1]._columns.few_rows_lane = False
    names = {number + 1: f"s{number}" for number in range(len(sequences))}
    opens = [pb.OpenSequence(sequence_id=names[number + 1], tokenizer=identity(name), handle=number + 1,
                             stop=STOPS[number % len(STOPS)], include_stop_str_in_output=bool(number % 2),
                             skip_special_tokens=bool(number % 3))
             for number, (name, _) in enumerate(sequences)]
    ended: set[int] = set()
    stopped = 0
    for step in range(max(len(ids) for _, ids in sequences) + 1):
        frame = pb.DetokenizeFrame(opens=opens if step == 0 else [])
        rows = [(handle, ids[step]) for handle, (_, ids) in zip(names, sequences, strict=True)
                if step < len(ids) and (handle in ended or rng.random() < 0.95)]  # late ids too
        rng.shuffle(rows)
        frame.columns.handles = pack_int32([handle for handle, _ in rows])
        frame.columns.num_tokens = pack_int32([1] * len(rows))
        frame.columns.token_ids = pack_int32([token_id for _, token_id in rows])
        frame.columns.finished_handles = pack_int32(
            [h for h, (_, ids) in zip(names, sequences, strict=True) if step == len(ids) - 1 and h not in ended])
        replies = [stream.apply(frame) for stream in streams]
        loop_answers, numpy_answers = (answers_of(reply, names) for reply in replies)
        assert loop_answers == numpy_answers, f"frame {step}"
        if few_rows_lane_only:  # the same reply to the byte, rows in the same order
            assert replies[0].SerializeToString() == replies[1].SerializeToString(), f"frame {step}"
        for name, answer in loop_answers.items():
            if answer[2]:
                ended.add(int(name[1:]) + 1)
                stopped += answer[3] >= 0
        loop_table, numpy_table = (stream._columns for stream in streams)
        live = np.flatnonzero(loop_table._status == _LIVE)
        assert np.array_equal(live, np.flatnonzero(numpy_table._status == _LIVE))
        for array in ("_pending", "_num_tokens", "_num_reported", "_held"):
            assert np.array_equal(getattr(loop_table, array)[live], getattr(numpy_table, array)[live]), array
    return stopped


def test_loop_and_numpy_pass_agree_on_one_table(decodings: dict[str, TokenizerDecoding],
                                                vocab_info: VocabInfo) -> None:
    """SmolLM2 alone: the one-step lane (every row live, one table, one id)."""
    rng = np.random.default_rng(1)
    texts = vocab_info["smollm2"][1]
    sequences = [("smollm2", list(texts[number % len(texts)])) for number in range(40)]
    sequences += [("smollm2", rng.integers(0, 300, size=30).tolist()) for _ in range(6)]  # lone bytes
    assert run_loop_and_numpy_pass(decodings, sequences, rng) > 0


def test_loop_and_numpy_pass_agree_on_mixed_tables(decodings: dict[str, TokenizerDecoding],
                                                   vocab_info: VocabInfo) -> None:
    """Two byte tables, the generic path and bad ids in one frame: the general flow, one group at a time."""
    rng = np.random.default_rng(2)
    sequences = []
    for name in ("smollm2", "cl100k", "llama2"):
        size, texts, _ = vocab_info[name]
        sequences += [(name, list(texts[number % len(texts)])) for number in range(12)]
        sequences.append((name, [5, 6, size + 2, 7]))  # an id outside the vocabulary ends it with an error
    assert run_loop_and_numpy_pass(decodings, sequences, rng) > 0


def record_few_rows_lane(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the few-rows lane took each frame offered to it, on every HandleTable from now on
    (the lane itself unchanged)."""
    taken: list[bool] = []
    lane = HandleTable._feed_few_plain

    def recorded(self: HandleTable, columns: Any, out: Any) -> bool:
        taken.append(lane(self, columns, out))
        return taken[-1]

    monkeypatch.setattr(HandleTable, "_feed_few_plain", recorded)
    return taken


def test_few_rows_lane_agrees_with_the_loop(decodings: dict[str, TokenizerDecoding], vocab_info: VocabInfo,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One to FEW_ROWS streams (the decode steps of a lightly loaded worker): frames of plain rows
    take the plain-Python lane, the others (a split character, a possible stop, held text, an id
    outside the vocabulary, a finished row, a late id) go on to the loop, and both leave the
    same answers and state as the loop alone."""
    taken = record_few_rows_lane(monkeypatch)
    rng = np.random.default_rng(3)
    for name in ("smollm2", "cl100k", "llama2"):
        size, texts, _ = vocab_info[name]
        for num_sequences in (1, 2, 5, FEW_ROWS, FEW_ROWS + 1):
            sequences = [(name, list(texts[(num_sequences + number) % len(texts)])) for number in range(num_sequences)]
            if num_sequences == 2:
                sequences.append((name, [5, 6, size + 2, 7]))  # an id outside the vocabulary ends it with an error
            if num_sequences == 5:
                sequences.append((name, rng.integers(0, 300, size=30).tolist()))  # lone bytes
            run_loop_and_numpy_pass(decodings, sequences, rng, few_rows_lane_only=True)
    assert any(taken) and not all(taken)


@pytest.mark.parametrize("bad", [0, -1, -(1 << 31), 62, 64, 128, 255, 256, 1 << 20, (1 << 31) - 1])
def test_handles_outside_the_open_ones_end_the_stream(decodings: dict[str, TokenizerDecoding], bad: int) -> None:
    """Handles are checked by one clipped gather: 0, negatives and those past the arrays land on
    slot 0 or the last slot, which no handle holds, and read as never opened."""
    stream = DetokenizeStream(lambda ident: decodings[ident.path])
    reply = stream.apply(pb.DetokenizeFrame(opens=[
        pb.OpenSequence(sequence_id=f"s{handle}", tokenizer=identity("smollm2"), handle=handle)
        for handle in (1, 61, 65, 127)]))  # 65 grows the arrays to 128 slots, 127 (the last) to 256
    assert not reply.deltas
    for frame_rows in ([(bad, [5])], [(1, [5]), (bad, [6])]):
        frame = pb.DetokenizeFrame()
        frame.columns.handles = pack_int32([handle for handle, _ in frame_rows])
        frame.columns.num_tokens = pack_int32([len(ids) for _, ids in frame_rows])
        frame.columns.token_ids = pack_int32([i for _, ids in frame_rows for i in ids])
        with pytest.raises(BadFrameError, match=f"handle {bad} was never opened"):
            stream.apply(frame)  # raises before any state changes: the stream object stays usable
    frame = pb.DetokenizeFrame()
    frame.columns.handles = pack_int32([1, 61, 65, 127])
    frame.columns.num_tokens = pack_int32([1] * 4)
    frame.columns.token_ids = pack_int32([28] * 4)
    assert stream.apply(frame).columns.text == decodings["smollm2"].tokenizer.decode([28]).encode() * 4


def test_continue_pending_decides_as_the_numpy_pass(smollm2_decoding: TokenizerDecoding) -> None:
    """Every unfinished-character start the table knows, after ids that may complete or grow it."""
    table = token_table_for(smollm2_decoding.token_bytes[False])
    candidates = np.flatnonzero((table.head > 0) | (table.continuation_len > 0)).tolist()
    candidates += np.random.default_rng(3).integers(0, table.vocab_size, size=300).tolist()
    seen = {"fits": 0, "grows": 0, "exact": 0}
    for pending in range(1, len(table.pending_info)):
        pending_data = table.pending_bytes(pending)
        state = int(table.pending_state[pending])
        missing = state & 0xFF
        for token_id in candidates[pending % 7::7]:
            second_ok = bool(VALID2[state >> 8, table.first[token_id]])
            head = int(table.head[token_id])
            data, new_pending = table.continue_pending(pending, token_id)
            if table.clean[token_id] and head == missing and second_ok:
                seen["fits"] += 1
                whole = pending_data + table.token_bytes.pieces[token_id]
                assert codecs.utf_8_decode(whole, "replace", False) == (data.decode("utf-8"), len(data))
                assert new_pending == table.tail_pending[token_id]
            elif second_ok and head < missing and table.continuation_len[token_id] and missing != STUCK:
                seen["grows"] += 1
                assert data is None
                assert table.pending_bytes(new_pending) == pending_data + table.token_bytes.pieces[token_id]
            else:
                seen["exact"] += 1
                assert (data, new_pending) == (None, -1)
    assert all(seen.values()), seen


def test_start_pieces_fit_the_empty_state(smollm2_decoding: TokenizerDecoding) -> None:
    table = token_table_for(smollm2_decoding.token_bytes[True])
    for token_id, piece in enumerate(table.token_bytes.pieces):
        start = table.start_pieces[token_id]
        if start is None:
            assert not (table.clean[token_id] and table.head[token_id] == 0)
            continue
        assert codecs.utf_8_decode(piece, "replace", False) == (start.decode("utf-8"), len(start))
        assert table.start_texts[token_id] == start


def test_held_text_released_only_when_no_stop_can_start() -> None:
    """StopStringMatcher.push's shortcut for held text: a suffix of it, not only all of it, may
    still become a stop with the new text."""
    matcher = StopStringMatcher(["xyz", "yq"])
    assert matcher.push("axy") == ("a", -1, 0)
    assert matcher.held_text == "xy"
    assert matcher.push("q") == ("x", 1, 1)  # "yq", a suffix of the held "xy" and the new "q"
    matcher = StopStringMatcher(["xyz", "yq"])
    matcher.push("axy")
    assert matcher.push("ab") == ("xyab", -1, 0)
    assert matcher.held_text == ""


@SETTINGS
@given(pieces=st.lists(st.text(alphabet="abxy\n", max_size=5), max_size=8),
       stops=st.lists(st.text(alphabet="axy\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_matcher_with_holds_matches_one_shot_reference(pieces: list[str], stops: list[str]) -> None:
    """Pieces that often start with a character no stop starts with ("b"), after held text."""
    matcher = StopStringMatcher(stops)
    emitted = ""
    for piece in pieces:
        out, stop_index, _ = matcher.push(piece)
        emitted += out
        if stop_index >= 0:
            break
    else:
        emitted += matcher.finish()
        stop_index = -1
    text = "".join(pieces)
    ref_index, ref_start, _ = reference_stop(text, stops)
    assert (stop_index, emitted) == (ref_index, text[:ref_start])


def watch_lanes(table: HandleTable) -> tuple[list[bool], list[int]]:
    """Records, without changing what they do, which frames the one-step lane took (one bool per
    frame of one id per row: False, the general flow) and [finished rows ended plainly, finished
    rows left for the exact path]."""
    lane_taken: list[bool] = []
    finish_counts = [0, 0]
    feed_one_step = table._feed_one_step
    finish_plain_rows = table._finish_plain_rows

    def watched_feed_one_step(*args: Any) -> bool:
        lane_taken.append(feed_one_step(*args))
        return lane_taken[-1]

    def watched_finish_plain_rows(*args: Any) -> np.ndarray:
        left = finish_plain_rows(*args)
        finish_counts[0] += args[3].size - left.size
        finish_counts[1] += left.size
        return left

    table._feed_one_step = watched_feed_one_step
    table._finish_plain_rows = watched_finish_plain_rows
    return lane_taken, finish_counts


def test_frames_with_finished_rows_take_the_one_step_lane(decodings: dict[str, TokenizerDecoding],
                                                          vocab_info: VocabInfo) -> None:
    """Staggered sequences, as an engine's steps send them: some sequence finishes on most frames,
    with its last id (a row) or after it (a finished handle alone). The other rows still take the
    one-id loop, the plain finished rows end there too, the others go the exact way; answers and
    state equal the numpy pass's, and texts tokenizer.decode's."""
    rng = np.random.default_rng(4)
    texts = vocab_info["smollm2"][1]
    tokenizer = decodings["smollm2"].tokenizer
    id_lists = [list(texts[number % len(texts)])[:int(rng.integers(3, 40))] for number in range(40)]
    id_lists += [rng.integers(0, 300, size=int(rng.integers(3, 20))).tolist() for _ in range(6)]  # lone bytes
    streams = [DetokenizeStream(lambda ident: decodings[ident.path]) for _ in range(2)]
    streams[1]._columns.one_id_loop = streams[1]._columns.few_rows_lane = False
    loop_table = streams[0]._columns
    lane_taken, finish_counts = watch_lanes(loop_table)
    names = {number + 1: f"s{number}" for number in range(len(id_lists))}
    starts = {handle: int(rng.integers(0, 12)) for handle in names}  # staggered start frames
    stops = {handle: STOPS[handle % len(STOPS)] if handle % 3 else [] for handle in names}
    # Every 4th sequence hears its end one frame after its last id, in a frame without its row.
    late_end = {handle: handle % 4 == 0 for handle in names}
    collected = {name: "" for name in names.values()}
    ended: set[int] = set()
    frames_with_finished = 0
    for step in range(60):
        frame = pb.DetokenizeFrame(opens=[
            pb.OpenSequence(sequence_id=names[handle], tokenizer=identity("smollm2"), handle=handle,
                            stop=stops[handle], skip_special_tokens=True)
            for handle, start in starts.items() if start == step])
        rows, finished = [], []
        for handle, ids in zip(names, id_lists, strict=True):
            position = step - starts[handle]
            if handle in ended or position < 0:
                continue
            if position < len(ids):
                rows.append((handle, ids[position]))
            if position == len(ids) - 1 + late_end[handle]:
                finished.append(handle)
        rng.shuffle(rows)
        frame.columns.handles = pack_int32([handle for handle, _ in rows])
        frame.columns.num_tokens = pack_int32([1] * len(rows))
        frame.columns.token_ids = pack_int32([token_id for _, token_id in rows])
        frame.columns.finished_handles = pack_int32(finished)
        lanes_before = len(lane_taken)
        loop_answers, numpy_answers = (answers_of(stream.apply(frame), names) for stream in streams)
        assert loop_answers == numpy_answers, f"frame {step}"
        finished_rows = len(set(finished) & {handle for handle, _ in rows})
        if finished and len(rows) > finished_rows:
            frames_with_finished += 1
            assert lane_taken[lanes_before:] == [True], f"frame {step}"
        for name, answer in loop_answers.items():
            collected[name] += answer[0]
            if answer[2]:
                ended.add(int(name[1:]) + 1)
        live = np.flatnonzero(loop_table._status == _LIVE)
        for array in ("_pending", "_num_tokens", "_num_reported", "_held"):
            assert np.array_equal(getattr(loop_table, array)[live], getattr(streams[1]._columns, array)[live]), array
    assert frames_with_finished > 15
    assert min(finish_counts) > 5, finish_counts  # both ways taken
    assert ended == set(names)
    for handle, ids in zip(names, id_lists, strict=True):
        if not stops[handle]:
            assert collected[names[handle]] == finished_text(
                decodings["smollm2"], tokenizer.decode(ids, skip_special_tokens=True), ids, True), names[handle]


def test_finished_rows_end_in_the_lane_only_when_their_end_is_plain(smollm2_decoding: TokenizerDecoding) -> None:
    """Each thing that makes a finished row's end more than its id's bytes (or the character its id
    completes, less one it leaves unfinished) sends it the exact way: an unfinished
    character the id does not complete, held text, an id that may start (here: completes) a stop.
    Checked against the numpy pass and by hand."""
    hello, newline, x, lead_e6, a, lead_c3, ab, tail_a9 = 28120, 198, 104, 177, 81, 142, 369, 119  # SmolLM2 ids
    space_e2_86 = 9943  # b" \xe2\x86": a space, then two bytes of a three-byte character
    sequences = {  # handle: (stops, ids); all but 6 and 7 finish with their last id's row
        1: ([], [hello, hello, x]),  # plain: ends in the loop's lane
        2: ([], [hello, lead_e6, a]),  # "\xe6" then "a": U+FFFD for the lone start byte
        3: (["\n\nObs"], [hello, newline, x]),  # "\n" held until "x" releases it
        4: (["\n\nObs"], [hello, hello, lead_c3]),  # ends inside a character: plain, the start dropped
        9: (["é"], [hello, hello, lead_c3]),  # the same, but a stop may start there: the exact way
        10: ([], [hello, hello, space_e2_86]),  # plain: " ", the two bytes of a character dropped
        5: (["ab"], [hello, hello, ab]),  # the last id completes a stop
        6: ([], [hello, hello, hello, hello]),  # goes on
        7: ([], [hello, hello]),  # its end comes alone, in the frame after its last id
        8: (["\n\nObs"], [hello, lead_c3, tail_a9]),  # completes "é": plain, ends in the loop's lane
    }
    streams = [DetokenizeStream(lambda _ident: smollm2_decoding) for _ in range(2)]
    streams[1]._columns.one_id_loop = False
    for stream in streams:  # the last frame's one plain row would take the lane of a few rows
        stream._columns.few_rows_lane = False
    lane_taken, finish_counts = watch_lanes(streams[0]._columns)
    names = {handle: f"s{handle}" for handle in sequences}
    finals: dict[int, tuple] = {}
    for step in range(4):
        frame = pb.DetokenizeFrame(opens=[
            pb.OpenSequence(sequence_id=names[handle], tokenizer=identity("smollm2"), handle=handle, stop=stops,
                            skip_special_tokens=True)
            for handle, (stops, _) in sequences.items()] if step == 0 else [])
        rows = [(handle, ids[step]) for handle, (_, ids) in sequences.items() if step < len(ids) and handle not in finals]
        frame.columns.handles = pack_int32([handle for handle, _ in rows])
        frame.columns.num_tokens = pack_int32([1] * len(rows))
        frame.columns.token_ids = pack_int32([token_id for _, token_id in rows])
        finished = [h for h, (_, ids) in sequences.items() if h != 6 and step == len(ids) - (h != 7) and h not in finals]
        frame.columns.finished_handles = pack_int32(finished + finished[:2])  # a handle named twice ends once
        loop_answers, numpy_answers = (answers_of(stream.apply(frame), names) for stream in streams)
        assert loop_answers == numpy_answers, f"frame {step}"
        finals.update({int(name[1:]): answer for name, answer in loop_answers.items() if answer[2]})
    assert lane_taken[2] and len(lane_taken) == 4
    assert finish_counts == [4, 4]  # 1, 4, 8 and 10 ended plainly; 2, 3, 5 and 9 the exact way
    # (text, num_tokens, finished, stop_index, num_tokens_to_stop, error) of each finished delta
    assert finals == {1: ("x", 1, True, -1, 0, ""), 2: ("\ufffda", 2, True, -1, 0, ""),
                      3: ("\nx", 2, True, -1, 0, ""), 4: ("", 1, True, -1, 0, ""),
                      5: ("", 1, True, 0, 3, ""), 7: ("", 0, True, -1, 0, ""), 8: ("é", 2, True, -1, 0, ""),
                      9: ("", 1, True, -1, 0, ""), 10: (" ", 1, True, -1, 0, "")}
