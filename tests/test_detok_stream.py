"""DetokenizeStream, the detok worker's frame loop, driven with real frames and no gRPC.

Many sequences per frame, byte-level and generic tokenizers side by side, stops and errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from detok_worker.stream import BadFrameError, DetokenizeStream
from tokenwire.packing import pack_int32
from tokenwire.tokenizer_files import tokenizer_identity
from tokenwire.v1 import common_pb2
from tokenwire.v1 import detok_worker_pb2 as pb

TEXTS = {
    "a": "Hello there! How are you doing today? 🙂",
    "b": "Der Bär läuft über die Brücke. Observation: done\n\nnext",
    "c": "東京は日本の首都です。それから",
}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def identity(smollm2_dir: Path) -> common_pb2.TokenizerIdentity:
    return tokenizer_identity(smollm2_dir)


@pytest.fixture(scope="module")
def metaspace_identity(tmp_path_factory: pytest.TempPathFactory) -> common_pb2.TokenizerIdentity:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator([*TEXTS.values(), "hello world, the end"] * 2,
                                  trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"]))
    directory = tmp_path_factory.mktemp("metaspace")
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer_identity(directory)


def open_seq(sequence_id: str, identity: common_pb2.TokenizerIdentity, stop: list[str] | None = None,
             **kwargs: object) -> pb.OpenSequence:
    return pb.OpenSequence(sequence_id=sequence_id, tokenizer=identity, stop=stop or [],
                           skip_special_tokens=True, **kwargs)


def tokens(sequence_id: str, ids: list[int], finished: bool = False) -> pb.SequenceTokenIds:
    return pb.SequenceTokenIds(sequence_id=sequence_id, token_ids=pack_int32(ids), finished=finished)


def by_id(reply: pb.TextDeltaFrame) -> dict[str, pb.TextDelta]:
    deltas = {d.sequence_id: d for d in reply.deltas}
    assert len(deltas) == len(reply.deltas), "one delta per sequence per frame"
    return deltas


def test_interleaved_sequences_decode_like_one_shot(smollm2: Tokenizer, identity: common_pb2.TokenizerIdentity) -> None:
    stream = DetokenizeStream()
    ids = {name: smollm2.encode(text).ids for name, text in TEXTS.items()}
    by_id(stream.apply(pb.DetokenizeFrame(opens=[open_seq(n, identity) for n in TEXTS])))
    texts = dict.fromkeys(TEXTS, "")
    positions = dict.fromkeys(TEXTS, 0)
    finished: set[str] = set()
    step = 0
    while len(finished) < len(TEXTS):
        entries = []
        for offset, name in enumerate(TEXTS):
            if name in finished:
                continue
            start = positions[name]
            end = positions[name] = start + 1 + (step + offset) % 3  # uneven chunks
            entries.append(tokens(name, ids[name][start:end], finished=end >= len(ids[name])))
        for name, delta in by_id(stream.apply(pb.DetokenizeFrame(tokens=entries))).items():
            assert delta.stop_index == -1 and not delta.error
            texts[name] += delta.text
            if delta.finished:
                finished.add(name)
        step += 1
    assert texts == TEXTS
    assert stream.live_sequence_ids == []


def test_quiet_sequences_get_no_delta(smollm2: Tokenizer, identity: common_pb2.TokenizerIdentity) -> None:
    stream = DetokenizeStream()
    stream.apply(pb.DetokenizeFrame(opens=[open_seq("x", identity), open_seq("y", identity)]))
    emoji = smollm2.encode("🙂").ids
    assert len(emoji) > 1
    reply = stream.apply(pb.DetokenizeFrame(tokens=[tokens("x", emoji[:1]), tokens("y", smollm2.encode("hi").ids)]))
    assert list(by_id(reply)) == ["y"]
    reply = stream.apply(pb.DetokenizeFrame(tokens=[tokens("x", emoji[1:]), tokens("x", emoji[:1], finished=True)]))
    delta = by_id(reply)["x"]
    assert (delta.text, delta.finished) == ("🙂", True)  # the cut emoji after it dropped, as vLLM drops it


def test_stop_hit_and_late_tokens(smollm2: Tokenizer, identity: common_pb2.TokenizerIdentity) -> None:
    stream = DetokenizeStream()
    text = TEXTS["b"]
    ids = smollm2.encode(text).ids
    stream.apply(pb.DetokenizeFrame(opens=[open_seq("s", identity, ["\n\n", "Observation:"]),
                                           open_seq("t", identity, ["Observation:"], include_stop_str_in_output=True)]))
    emitted = {"s": "", "t": ""}
    stopped: dict[str, pb.TextDelta] = {}
    for i, token_id in enumerate(ids):
        entries = [tokens(name, [token_id]) for name in emitted]
        for name, delta in by_id(stream.apply(pb.DetokenizeFrame(tokens=entries))).items():
            assert name not in stopped, "no delta after the stop"
            emitted[name] += delta.text
            if delta.finished:
                stopped[name] = delta
                assert delta.num_tokens_to_stop == i + 1
    assert emitted == {"s": text[:text.index("Observation:")], "t": text[:text.index("Observation:") + 12]}
    assert stopped["s"].stop_index == 1 and stopped["t"].stop_index == 0
    assert "Observation:" in smollm2.decode(ids[:stopped["s"].num_tokens_to_stop])
    assert "Observation:" not in smollm2.decode(ids[:stopped["s"].num_tokens_to_stop - 1])
    # The gateway's end of input for a stopped sequence is dropped quietly, then forgotten.
    assert not stream.apply(pb.DetokenizeFrame(tokens=[tokens("s", [], finished=True)])).deltas
    assert by_id(stream.apply(pb.DetokenizeFrame(tokens=[tokens("s", [1])])))["s"].error


def test_per_sequence_errors_leave_others_running(smollm2: Tokenizer, identity: common_pb2.TokenizerIdentity,
                                                  tmp_path: Path) -> None:
    stream = DetokenizeStream()
    wrong_hash = common_pb2.TokenizerIdentity(path=identity.path, sha256="0" * 64)
    reply = stream.apply(pb.DetokenizeFrame(opens=[
        open_seq("ok", identity), open_seq("bad", identity),
        open_seq("nodir", common_pb2.TokenizerIdentity(path=str(tmp_path / "missing"))),
        open_seq("hash", wrong_hash), open_seq("emptystop", identity, ["x", ""]),
    ]))
    errors = {d.sequence_id: d.error for d in reply.deltas}
    assert set(errors) == {"nodir", "hash", "emptystop"}
    assert all(d.finished and d.stop_index == -1 for d in reply.deltas)
    assert "no tokenizer.json" in errors["nodir"] and "sha256" in errors["hash"] and "empty" in errors["emptystop"]
    hello = smollm2.encode("Hello").ids
    reply = by_id(stream.apply(pb.DetokenizeFrame(
        opens=[open_seq("ok", identity)],  # duplicate of a live id: closes it with an error
        tokens=[tokens("bad", [*hello, 49152]), tokens("ghost", hello),
                pb.SequenceTokenIds(sequence_id="ok", token_ids=b"\x01\x02\x03")],
    )))
    assert "already open" in reply["ok"].error and reply["ok"].finished
    assert "49152" in reply["bad"].error and reply["bad"].text == ""
    assert "no open sequence" in reply["ghost"].error
    assert stream.live_sequence_ids == []
    stream.apply(pb.DetokenizeFrame(opens=[open_seq("bad", identity), open_seq("good", identity)]))
    reply = by_id(stream.apply(pb.DetokenizeFrame(tokens=[
        tokens("bad", [-5]), tokens("good", hello),
        pb.SequenceTokenIds(sequence_id="good", token_ids=b"\x00"),
    ])))
    # A bad entry fails its sequence for the whole frame: no text from its other entries.
    assert reply["good"].text == "" and "not a multiple of 4" in reply["good"].error
    assert "-5" in reply["bad"].error


def test_close_drops_without_flush(smollm2: Tokenizer, identity: common_pb2.TokenizerIdentity) -> None:
    stream = DetokenizeStream()
    stream.apply(pb.DetokenizeFrame(opens=[open_seq("c", identity, ["Observation:"])]))
    reply = stream.apply(pb.DetokenizeFrame(tokens=[tokens("c", smollm2.encode("Obs").ids)],
                                            closes=[pb.CloseSequence(sequence_id="c")]))
    assert not reply.deltas and stream.live_sequence_ids == []


def test_frames_without_sequence_ids_are_refused(identity: common_pb2.TokenizerIdentity) -> None:
    for frame in (pb.DetokenizeFrame(opens=[open_seq("", identity)]),
                  pb.DetokenizeFrame(tokens=[tokens("", [1])]),
                  pb.DetokenizeFrame(closes=[pb.CloseSequence()])):
        with pytest.raises(BadFrameError):
            DetokenizeStream().apply(frame)


def test_generic_and_byte_level_in_one_frame(smollm2: Tokenizer, identity: common_pb2.TokenizerIdentity,
                                             metaspace_identity: common_pb2.TokenizerIdentity) -> None:
    metaspace = Tokenizer.from_file(str(Path(metaspace_identity.path) / "tokenizer.json"))
    text = "hello world, the end"
    prompt_tail = metaspace.encode("the end").ids
    ms_ids = metaspace.encode(text).ids
    bl_ids = smollm2.encode(text).ids
    stream = DetokenizeStream()
    stream.apply(pb.DetokenizeFrame(opens=[
        open_seq("ms", metaspace_identity, ["end"], prompt_tail_ids=prompt_tail), open_seq("bl", identity, ["end"])]))
    emitted = {"ms": "", "bl": ""}
    for i in range(max(len(ms_ids), len(bl_ids))):
        entries = [tokens(name, ids[i:i + 1]) for name, ids in (("ms", ms_ids), ("bl", bl_ids)) if i < len(ids)]
        for name, delta in by_id(stream.apply(pb.DetokenizeFrame(tokens=entries))).items():
            emitted[name] += delta.text
    # The prompt tail gives the first generated word its leading space back.
    assert emitted == {"ms": " hello world, the ", "bl": "hello world, the "}
