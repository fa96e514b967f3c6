"""The column path (TokenColumns / TextColumns, detok_worker/columns.py) against the message path.

The same frames go through two DetokenizeStreams in lockstep, one as SequenceTokenIds entries and
one as handled column rows, and every frame's answer per sequence must be the same: text, token
accounting, finish, stop index, error. Plus the handle rules on their own.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detok_worker.stream import BadFrameError, DetokenizeStream
from detok_worker.token_bytes import TokenizerDecoding
from detok_worker.token_table import NEED, VALID2, TokenTable, held_back
from tests.detok_tokenizers import SAMPLE_TEXTS, cl100k, llama2_style
from tokenwire.packing import pack_int32, unpack_int32
from tokenwire.v1 import common_pb2
from tokenwire.v1 import detok_worker_pb2 as pb

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
STOP_CANDIDATES = ["\n\n", "</", "\n", ".", "Straße", "日本", "🙂", "👍🏽", " the", "x**", "Всё", "é", "oo", "ß"]
# (text, num_tokens, finished, stop_index, num_tokens_to_stop, error) per sequence per frame.
Answer = tuple[str, int, bool, int, int, str]


@pytest.fixture(scope="module")
def decodings(smollm2_decoding: TokenizerDecoding) -> dict[str, TokenizerDecoding]:
    return {"smollm2": smollm2_decoding, "cl100k": TokenizerDecoding(cl100k()),
            "llama2": TokenizerDecoding(llama2_style())}


@dataclass
class Plan:
    """One sequence of a run: what it decodes and when it sends what."""

    tokenizer: str
    ids: list[int]
    chunks: list[int]  # ids per frame from its opening frame on (0: absent that frame)
    stops: list[str]
    include_stop: bool
    skip_special: bool
    open_at: int
    end: str  # "flag": finished with the last ids; "alone": finished in a frame of its own; "close"
    sent: int = 0
    sent_last: bool = False  # the gateway sent its finish or close
    ended_at: int | None = None  # the frame whose answer finished it
    done_at: int | None = None  # the frame from which the gateway knows it ended (handle free)
    handle: int = 0
    sequence_id: str = ""
    answers: list[Answer] = field(default_factory=list)


VocabInfo = dict[str, tuple[int, list[list[int]], Callable[[list[int]], str]]]


def id_lists(decodings_vocab: VocabInfo) -> st.SearchStrategy[tuple[str, list[int]]]:
    """Real multi-script text, single bytes (partial characters), specials, any id, some out of vocab."""
    def ids_for(name: str) -> st.SearchStrategy[tuple[str, list[int]]]:
        vocab_size, texts_ids, _ = decodings_vocab[name]
        pieces = st.one_of(
            st.sampled_from(texts_ids).flatmap(lambda ids: st.integers(0, len(ids)).map(lambda s: ids[s:s + 12])),
            st.lists(st.integers(0, 300), max_size=4),
            st.lists(st.integers(0, vocab_size - 1), max_size=3),
            st.lists(st.sampled_from([vocab_size - 1, vocab_size - 2, 0, 1, 2]), max_size=2),
            st.lists(st.integers(vocab_size, vocab_size + 3) | st.just(-1), min_size=1, max_size=1),
        )
        weights = st.lists(pieces, max_size=6).map(lambda parts: [i for p in parts for i in p])
        return weights.map(lambda ids: (name, ids))
    return st.sampled_from(sorted(decodings_vocab)).flatmap(ids_for)


@st.composite
def plans(draw: st.DrawFn, decodings_vocab: VocabInfo) -> list[Plan]:
    result = []
    for _ in range(draw(st.integers(1, 7))):
        name, ids = draw(id_lists(decodings_vocab))
        vocab_size, _, decode = decodings_vocab[name]
        if draw(st.integers(0, 9)) and any(i < 0 or i >= vocab_size for i in ids):
            ids = [i for i in ids if 0 <= i < vocab_size]  # out-of-vocab ids: 1 run in 10
        stops = draw(st.lists(st.sampled_from(STOP_CANDIDATES), max_size=3))
        text = decode([i for i in ids if 0 <= i < vocab_size])
        if text and draw(st.booleans()):  # a stop the text holds, often split across ids
            start = draw(st.integers(0, len(text) - 1))
            stops.insert(draw(st.integers(0, len(stops))), text[start:start + draw(st.integers(1, 4))])
        result.append(Plan(
            tokenizer=name, ids=ids,
            chunks=draw(st.lists(st.integers(0, 4), max_size=10)),
            stops=stops,
            include_stop=draw(st.booleans()), skip_special=draw(st.booleans()),
            open_at=draw(st.integers(0, 4)), end=draw(st.sampled_from(["flag", "flag", "alone", "close"]))))
    return result


def identity(name: str) -> common_pb2.TokenizerIdentity:
    return common_pb2.TokenizerIdentity(path=name)


def open_message(plan: Plan, handle: int) -> pb.OpenSequence:
    return pb.OpenSequence(sequence_id=plan.sequence_id, tokenizer=identity(plan.tokenizer),
                           skip_special_tokens=plan.skip_special, stop=plan.stops,
                           include_stop_str_in_output=plan.include_stop, handle=handle)


def answers_of(reply: pb.TextDeltaFrame, names: dict[int, str]) -> dict[str, Answer]:
    """Per sequence id, whichever of the reply's two forms carried it (never both)."""
    answers = {d.sequence_id: (d.text, d.num_tokens, d.finished, d.stop_index, d.num_tokens_to_stop, d.error)
               for d in reply.deltas}
    assert len(answers) == len(reply.deltas)
    columns = reply.columns
    handles = unpack_int32(columns.handles).tolist()
    lengths = unpack_int32(columns.text_lengths).tolist()
    counts = unpack_int32(columns.num_tokens).tolist()
    assert len(lengths) == len(handles) == len(counts)
    assert sum(lengths) == len(columns.text)
    start = 0
    for handle, length, count in zip(handles, lengths, counts, strict=True):
        assert length > 0
        text = columns.text[start:start + length].decode("utf-8")  # raises if a row split a character
        start += length
        name = names[handle]
        assert name not in answers, "a sequence in both the deltas and the columns"
        answers[name] = (text, count, False, -1, 0, "")
    return answers


def run_lockstep(decodings: dict[str, TokenizerDecoding], plans_: list[Plan], delay: int) -> None:
    """Feeds both streams the same frames; the gateway side hears replies `delay` frames late, so
    ids keep coming for a while after a stop or an error, and a freed handle is reused at once."""
    open_decoding = decodings.__getitem__
    messages = DetokenizeStream(lambda ident: open_decoding(ident.path))
    columns = DetokenizeStream(lambda ident: open_decoding(ident.path))
    free_handles: list[int] = []
    next_handle = 1
    names: dict[int, str] = {}
    for number, plan in enumerate(plans_):
        plan.sequence_id = f"s{number}"
    last_frame = max(p.open_at + len(p.chunks) for p in plans_) + 3 + delay
    for frame_index in range(last_frame):
        for plan in plans_:
            if plan.done_at is not None and plan.done_at <= frame_index and plan.handle:
                free_handles.append(plan.handle)
                names.pop(plan.handle)
                plan.handle = 0
        message_frame = pb.DetokenizeFrame()
        rows: list[tuple[int, list[int]]] = []
        finished_handles: list[int] = []
        for plan in plans_:
            step = frame_index - plan.open_at
            if step < 0 or (plan.done_at is not None and frame_index >= plan.done_at):
                continue
            if step == 0:
                free_handles.sort(reverse=True)
                if free_handles:
                    plan.handle = free_handles.pop()
                else:
                    plan.handle, next_handle = next_handle, next_handle + 1
                names[plan.handle] = plan.sequence_id
                message_frame.opens.append(open_message(plan, 0))
            if plan.sent_last:
                continue
            chunk = plan.chunks[step] if step < len(plan.chunks) else len(plan.ids) - plan.sent
            ids = plan.ids[plan.sent:plan.sent + chunk]
            plan.sent += len(ids)
            last = step >= len(plan.chunks)
            if last and plan.end == "close":
                message_frame.closes.append(pb.CloseSequence(sequence_id=plan.sequence_id))
                plan.sent_last = True
                plan.done_at = frame_index + 1 + delay
                continue
            finished = last and (plan.end == "flag" or not ids)
            if ids or finished:
                message_frame.tokens.append(pb.SequenceTokenIds(
                    sequence_id=plan.sequence_id, token_ids=pack_int32(ids), finished=finished))
                if ids or (step % 2):  # a finished row with no ids, or the handle alone
                    rows.append((plan.handle, ids))
                if finished:
                    finished_handles.append(plan.handle)
                    plan.sent_last = True  # sends nothing more; its delta frees the handle
        column_frame = pb.DetokenizeFrame()
        column_frame.CopyFrom(message_frame)
        del column_frame.tokens[:]
        for open_ in column_frame.opens:
            open_.handle = next(h for h, n in names.items() if n == open_.sequence_id)
        if rows or finished_handles:
            column_frame.columns.handles = pack_int32([h for h, _ in rows])
            column_frame.columns.num_tokens = pack_int32([len(ids) for _, ids in rows])
            column_frame.columns.token_ids = pack_int32([i for _, ids in rows for i in ids])
            column_frame.columns.finished_handles = pack_int32(finished_handles)
        expected = answers_of(messages.apply(message_frame), {})
        got = answers_of(columns.apply(column_frame), dict(names))
        for plan in plans_:
            if plan.ended_at is not None and plan.ended_at < frame_index:
                # Late ids of an ended sequence: the column path drops them quietly; the message
                # path too after a stop, with an error delta after an error (nobody reads either).
                assert plan.sequence_id not in got
                late = expected.pop(plan.sequence_id, None)
                assert late is None or "no open sequence" in late[5]
        assert got == expected, f"frame {frame_index}"
        for plan in plans_:
            answer = expected.get(plan.sequence_id)
            if answer is None:
                continue
            plan.answers.append(answer)
            if answer[2] and plan.ended_at is None:
                plan.ended_at = frame_index
                if plan.done_at is None:
                    plan.done_at = frame_index + 1 + delay
    for plan in plans_:
        if plan.end != "close" and plan.open_at < last_frame:
            assert any(a[2] for a in plan.answers), f"{plan.sequence_id} never finished"


@pytest.fixture(scope="module")
def vocab_info(decodings: dict[str, TokenizerDecoding]) -> VocabInfo:
    info: VocabInfo = {}
    for name, decoding in decodings.items():
        tokenizer = decoding.tokenizer
        if tokenizer is not None:
            encoded = [tokenizer.encode(text, add_special_tokens=False).ids for text in SAMPLE_TEXTS]
            info[name] = (decoding.vocab_size, encoded, tokenizer.decode)
        else:
            encoding = cl100k()
            encoded = [encoding.encode(text) for text in SAMPLE_TEXTS]
            pieces = decoding.token_bytes[False].pieces if decoding.token_bytes else []
            info[name] = (decoding.vocab_size, encoded,
                          lambda ids, p=pieces: b"".join(p[i] for i in ids).decode("utf-8", "replace"))
    return info


def test_random_runs_match_the_message_path(decodings: dict[str, TokenizerDecoding],
                                            vocab_info: VocabInfo) -> None:
    @SETTINGS
    @given(plans_=plans(vocab_info), delay=st.integers(0, 2))
    def check(plans_: list[Plan], delay: int) -> None:
        run_lockstep(decodings, plans_, delay)

    check()


def test_real_text_many_sequences_match(decodings: dict[str, TokenizerDecoding],
                                        vocab_info: VocabInfo) -> None:
    """Whole multi-script texts, one id per frame (the decode case), stops split across ids."""
    rng = np.random.default_rng(5)
    plans_ = []
    for name in ("smollm2", "cl100k"):
        for number, ids in enumerate(vocab_info[name][1] * 3):
            plans_.append(Plan(tokenizer=name, ids=list(ids), chunks=[1] * len(ids),
                               stops=list(rng.choice(STOP_CANDIDATES, size=number % 3, replace=False)),
                               include_stop=bool(number % 2), skip_special=bool(number % 4 < 2),
                               open_at=number % 3, end="flag"))
    run_lockstep(decodings, plans_, delay=1)
    stopped = [p for p in plans_ if p.answers and p.answers[-1][3] >= 0]
    assert stopped, "the stops should hit some of these texts"


def test_utf8_tables_match_cpython(decodings: dict[str, TokenizerDecoding]) -> None:
    """columns.py's UTF-8 tables agree with CPython's decoder, and so does every id's split."""
    for lead in range(0xC2, 0xF5):
        for second in range(0x80, 0xC0):
            whole = bytes([lead, second, *[0x80] * (int(NEED[lead]) - 2)])
            assert bool(VALID2[lead, second]) == (codecs.utf_8_decode(whole, "replace", True)[0] == whole.decode(
                "utf-8", "replace") and "\ufffd" not in whole.decode("utf-8", "replace"))
    for name in ("smollm2", "cl100k"):
        table = TokenTable(decodings[name].token_bytes[False])
        for token_id, piece in enumerate(table.token_bytes.pieces):
            if not table.clean[token_id] or table.head[token_id]:
                continue
            cut = len(piece) - int(table.tail[token_id])
            assert codecs.utf_8_decode(piece, "replace", False) == (piece[:cut].decode("utf-8"), cut)
            assert table.join_pieces[table.vocab_size + token_id] == piece[:cut]
            assert held_back(piece[cut:]) or cut == len(piece)


@pytest.mark.parametrize("stops", [tuple(f"{c}x" for c in "etaoinshrdlucmfw"), ("\n\nUser:", "é!"), (" the",)])
def test_stop_flags_check_each_id_as_it_comes_and_agree_with_checking_every_id(
        decodings: dict[str, TokenizerDecoding], stops: tuple[str, ...]) -> None:
    # Checking the whole vocabulary for each new stop set cost 30-56 ms of the event loop (SmolLM2,
    # 16 stops), and a frame finishing 300 requests with stops of their own 9.3 s (review 96).
    from detok_worker.stop_strings import StopStringMatcher
    from detok_worker.token_table import char_mask

    table = TokenTable(decodings["smollm2"].token_bytes[False])
    checked: list[int] = []
    check = table._starts_stop
    table._starts_stop = lambda could_start, token_id: checked.append(token_id) or check(could_start, token_id)
    frame_ids = np.array([table.vocab_size - 1, 5, 900, 900, 31000, 12, 5])
    first = table.stop_flags(stops, frame_ids)
    assert len(checked) <= len(set(frame_ids.tolist())) and len(set(checked)) == len(checked)
    assert table.stop_flags(stops, frame_ids).tolist() == first.tolist() and len(checked) <= 5  # once each
    # Every id, as the table checked them all at once before.
    could_start = StopStringMatcher(stops).could_start
    low, high = char_mask("".join(stop[0] for stop in stops))
    expected = ((table.mask_low & np.uint64(low)) | (table.mask_high & np.uint64(high))) != 0
    if all(ord(stop[0]) < 128 for stop in stops):
        for token_id in np.flatnonzero(expected & table.clean).tolist():
            piece = table.token_bytes.pieces[token_id]
            expected[token_id] = could_start(piece[table.head[token_id]:len(piece) - table.tail[token_id]].decode())
    every_id = np.arange(table.vocab_size)
    assert table.stop_flags(stops, every_id).tolist() == expected.tolist()
    assert [table.stop_flag(stops, i) for i in frame_ids.tolist()] == expected[frame_ids].tolist()
    assert expected.any() and not expected.all()


# ---- handle rules ----

def handled_stream(decodings: dict[str, TokenizerDecoding]) -> DetokenizeStream:
    return DetokenizeStream(lambda ident: decodings[ident.path])


def column_frame(rows: list[tuple[int, list[int]]], finished: list[int] = ()) -> pb.DetokenizeFrame:
    frame = pb.DetokenizeFrame()
    frame.columns.handles = pack_int32([h for h, _ in rows])
    frame.columns.num_tokens = pack_int32([len(ids) for _, ids in rows])
    frame.columns.token_ids = pack_int32([i for _, ids in rows for i in ids])
    frame.columns.finished_handles = pack_int32(list(finished))
    return frame


def test_unknown_or_repeated_handles_end_the_stream(decodings: dict[str, TokenizerDecoding]) -> None:
    stream = handled_stream(decodings)
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="a", tokenizer=identity("smollm2"), handle=3)]))
    with pytest.raises(BadFrameError, match="handle 4 was never opened"):
        stream.apply(column_frame([(4, [1])]))
    with pytest.raises(BadFrameError, match="twice"):
        stream.apply(column_frame([(3, [1]), (3, [2])]))
    with pytest.raises(BadFrameError, match="adds up to 3"):
        frame = column_frame([(3, [1, 2, 3])])
        frame.columns.token_ids = pack_int32([1])
        stream.apply(frame)
    with pytest.raises(BadFrameError, match="handle 9 was never opened"):
        stream.apply(column_frame([], finished=[9]))


def test_reply_always_has_columns(decodings: dict[str, TokenizerDecoding]) -> None:
    stream = handled_stream(decodings)
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="a", tokenizer=identity("smollm2"), handle=1)]))
    reply = stream.apply(column_frame([]))
    assert reply.HasField("columns")
    assert not stream.apply(pb.DetokenizeFrame()).HasField("columns")


def test_handle_conflicts_and_range(decodings: dict[str, TokenizerDecoding]) -> None:
    stream = handled_stream(decodings)
    reply = stream.apply(pb.DetokenizeFrame(opens=[
        pb.OpenSequence(sequence_id="a", tokenizer=identity("smollm2"), handle=2),
        pb.OpenSequence(sequence_id="b", tokenizer=identity("smollm2"), handle=2),
        pb.OpenSequence(sequence_id="c", tokenizer=identity("smollm2"), handle=1 << 20),
    ]))
    errors = {d.sequence_id: d.error for d in reply.deltas}
    assert "opened again" in errors["a"] and "already used by open sequence 'a'" in errors["b"]
    assert "out of range" in errors["c"]
    assert stream.live_sequence_ids == []
    # Both ended: the handle's late ids are dropped quietly, and it can be opened again.
    assert not stream.apply(column_frame([(2, [5])])).deltas
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="d", tokenizer=identity("smollm2"), handle=2)]))
    assert stream.live_sequence_ids == ["d"]


def test_handled_sequence_refuses_message_entries(decodings: dict[str, TokenizerDecoding]) -> None:
    stream = handled_stream(decodings)
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="a", tokenizer=identity("smollm2"), handle=1)]))
    reply = stream.apply(pb.DetokenizeFrame(tokens=[pb.SequenceTokenIds(sequence_id="a", token_ids=pack_int32([5]))]))
    assert "DetokenizeFrame.columns" in reply.deltas[0].error and reply.deltas[0].finished


def test_stale_ids_after_a_stop_are_dropped_and_the_handle_reused(decodings: dict[str, TokenizerDecoding],
                                                                    smollm2) -> None:
    stream = handled_stream(decodings)
    ids = smollm2.encode("Hello world. Bye").ids
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="a", tokenizer=identity("smollm2"),
                                                           handle=1, stop=["."])]))
    texts = []
    for token_id in ids:
        reply = stream.apply(column_frame([(1, [token_id])]))
        texts.append(reply.columns.text.decode() + "".join(d.text for d in reply.deltas))
        assert not any(d.error for d in reply.deltas)
    assert "".join(texts) == "Hello world"
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="b", tokenizer=identity("smollm2"), handle=1)]))
    reply = stream.apply(column_frame([(1, ids[:2])]))
    assert reply.columns.text.decode() == smollm2.decode(ids[:2])
    assert unpack_int32(reply.columns.num_tokens).tolist() == [2]


# ---- the gateway's side: handles of one DetokClient stream ----

async def test_detok_client_reuses_handles_only_when_safe() -> None:
    import grpc

    from gateway.detok_client import DetokClient

    replies: list[pb.TextDeltaFrame] = []
    client = DetokClient("127.0.0.1:9", grpc.aio.insecure_channel("127.0.0.1:9"),
                         lambda _client, frame: replies.append(frame), lambda _client, _error: None)
    opens = [pb.OpenSequence(sequence_id=name) for name in ("a", "b", "c")]
    for open_ in opens:
        client.assign_handle(open_)
    assert [o.handle for o in opens] == [1, 2, 3]
    client.send(opens, (), [("a", pack_int32([5, 6]), False), ("b", pack_int32([7]), True)])
    client.send((), (), [("a", pack_int32([8]), False)])  # merged into a's row
    frame = client._take_frame()
    assert unpack_int32(frame.columns.handles).tolist() == [1, 2]
    assert unpack_int32(frame.columns.num_tokens).tolist() == [3, 1]
    assert unpack_int32(frame.columns.token_ids).tolist() == [5, 6, 8, 7]
    assert unpack_int32(frame.columns.finished_handles).tolist() == [2]
    # b's finished delta is read: its queued (stale) ids go, its handle is free at once.
    client.send((), (), [("b", pack_int32([9]), False)])
    reply = pb.TextDeltaFrame()
    reply.columns.SetInParent()  # a worker that reads columns always answers them
    client._reply(reply)
    client.sequence_finished("b")
    assert 2 not in client._rows
    reused = pb.OpenSequence(sequence_id="d")
    client.assign_handle(reused)
    assert reused.handle == 2 and client.sequence_of_handle[2] == "d"
    # c is closed: its handle waits for the reply to the frame carrying the close.
    client.close_sequence("c")
    client._take_frame()
    late = pb.OpenSequence(sequence_id="e")
    client.assign_handle(late)
    assert late.handle == 4
    client._reply(pb.TextDeltaFrame())  # the reply to the frame that carried the close
    again = pb.OpenSequence(sequence_id="f")
    client.assign_handle(again)
    assert again.handle == 3


async def test_detok_client_frames_stay_within_their_id_budget() -> None:
    """A replay sends every open sequence's ids at once: whole sequences past the budget wait for
    the next frame (one bigger than the budget goes alone), in order, none lost or repeated."""
    import grpc

    from gateway.detok_client import DetokClient

    client = DetokClient("127.0.0.1:9", grpc.aio.insecure_channel("127.0.0.1:9"),
                         lambda _client, _frame: None, lambda _client, _error: None)
    client.max_frame_id_bytes = 12  # 3 ids
    handled = [pb.OpenSequence(sequence_id=name) for name in ("r", "s")]
    for open_ in handled:
        client.assign_handle(open_)
    plain = [pb.OpenSequence(sequence_id=name) for name in ("a", "b", "c")]
    ids = {"a": [1, 2], "b": [3, 4], "c": [5, 6, 7, 8, 9], "r": [10], "s": [11, 12]}
    client.send([*plain, *handled], [pb.SequenceTokenIds(sequence_id=n, token_ids=pack_int32(ids[n]), finished=True)
                                     for n in ("a", "b", "c")],
                [(n, pack_int32(ids[n]), True) for n in ("r", "s")])
    assert client.stream._wake.is_set()
    client.stream._wake.clear()
    frames = []
    while (frame := client._take_frame()) is not None:
        frames.append(frame)
        assert client.stream._wake.is_set() == bool(client._tokens or client._rows)  # the rest goes next
        client.stream._wake.clear()
    got: dict[str, list[int]] = {}
    shape = []
    for frame in frames:
        shape.append([e.sequence_id for e in frame.tokens] + [client.sequence_of_handle[h] for h in
                                                              unpack_int32(frame.columns.handles).tolist()])
        for entry in frame.tokens:
            assert entry.finished
            got.setdefault(entry.sequence_id, []).extend(unpack_int32(entry.token_ids).tolist())
        counts = unpack_int32(frame.columns.num_tokens).tolist()
        row_ids = unpack_int32(frame.columns.token_ids).tolist()
        for handle, count in zip(unpack_int32(frame.columns.handles).tolist(), counts, strict=True):
            got.setdefault(client.sequence_of_handle[handle], []).extend(row_ids[:count])
            row_ids = row_ids[count:]
        assert set(unpack_int32(frame.columns.finished_handles).tolist()) == set(
            unpack_int32(frame.columns.handles).tolist())
    assert shape == [["a", "r"], ["b"], ["c"], ["s"]], shape  # r's one id fits beside a's two
    assert got == ids
    assert [len(f.opens) for f in frames] == [5, 0, 0, 0]


async def test_detok_client_falls_back_when_the_worker_ignores_columns() -> None:
    import grpc

    from gateway.detok_client import DetokClient
    from gateway.frame_stream import ResetStream

    lost: list[Exception] = []
    client = DetokClient("127.0.0.1:9", grpc.aio.insecure_channel("127.0.0.1:9"),
                         lambda _client, _frame: None, lambda _client, error: lost.append(error))
    open_ = pb.OpenSequence(sequence_id="a")
    client.assign_handle(open_)
    client.send([open_], (), [("a", pack_int32([5]), False)])
    assert client._take_frame().HasField("columns")
    # A second frame of columns is in flight, and a third row waits, when the first reply comes.
    client.send((), (), [("a", pack_int32([6]), False)])
    assert client._take_frame().HasField("columns")
    client.send((), (), [("a", pack_int32([7]), False)])
    with pytest.raises(ResetStream, match="does not read TokenColumns"):
        client._reply(pb.TextDeltaFrame())  # an older worker: no TextColumns in the reply
    # The stream ends once: FrameStream runs the loss path, which forgets every row and handle.
    client._lost(ConnectionError("reset"))
    assert len(lost) == 1 and client._take_frame() is None
    later = pb.OpenSequence(sequence_id="b")
    client.assign_handle(later)
    assert later.handle == 0 and not client.has_handle("b")
