"""min_tokens with stop strings (OpenSequence.min_tokens): a stop counts only where it ends after
the text of the first min_tokens ids, as vLLM's detokenizer has it (vLLM PR 22014), on every path
of the detok worker: byte-level entries, column rows, and the generic (window) detokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from detok_worker.stop_strings import StopStringMatcher
from detok_worker.stream import DetokenizeStream
from tests.detok_tokenizers import llama2_style
from tokenwire.packing import pack_int32, unpack_int32
from tokenwire.tokenizer_files import tokenizer_identity
from tokenwire.v1 import common_pb2
from tokenwire.v1 import detok_worker_pb2 as pb

TEXT = "Hello there, and the rest. Then everyone went home, the end."
REPLACEMENT_CHAR = "\ufffd"


def test_unchecked_text_passes_stops_through_and_holds_a_possible_start():
    matcher = StopStringMatcher(["the end", "ere"])
    # A whole stop in unchecked text is no hit; what could start one stays held.
    assert matcher.push_unchecked("Hello there") == "Hello ther"
    assert matcher.held_text == "e"  # could start "ere"
    assert matcher.push_unchecked(", so th") == "e, so "
    assert matcher.held_text == "th"  # could start "the end"
    # A stop that starts in the unchecked text and ends after it is found from its start.
    assert matcher.push("e end!") == ("", 0, 5)


def test_a_stop_ending_in_unchecked_text_is_none_but_one_starting_there_counts():
    matcher = StopStringMatcher(["xey", "e"])
    # "xe" could start "xey": held, though a whole "e" ends in it.
    assert matcher.push_unchecked("axe") == "a"
    assert matcher.held_text == "xe"
    # "xey" ends in checked text and first; the "e" of the unchecked "xe" is no hit.
    assert matcher.push("y e") == ("", 0, 1)
    other = StopStringMatcher(["xey", "e"])
    other.push_unchecked("axe")
    assert other.push("z e") == ("xez ", 1, 3)  # the held "xe" goes out; the next "e" is a hit
    # Pushes that keep the unchecked text held (an empty one: a token ending inside a character)
    # keep it unchecked.
    third = StopStringMatcher(["xey", "e"])
    third.push_unchecked("axe")
    assert third.push("") == ("", -1, 0)
    assert third.held_text == "xe"
    assert third.push("z") == ("xez", -1, 0)  # the held "e" was never a hit
    # So do pushes that hold it on as the start of a longer stop.
    fourth = StopStringMatcher(["xeyz", "e"])
    assert fourth.push_unchecked("axe") == "a"
    assert fourth.push("y") == ("", -1, 0)
    assert fourth.held_text == "xey"
    assert fourth.push("e") == ("xey", 1, 1)  # the checked "e" is the hit, not the held one


@settings(max_examples=1000, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=12), unchecked=st.integers(0, 40), include=st.booleans())
def test_matcher_against_the_rule(text, stops, cuts, unchecked, include):
    """Pieces of text (empty ones too) pushed unchecked up to `unchecked` characters, then checked:
    the cut is where the earliest-ending stop that ends past those characters says."""
    unchecked = min(unchecked, len(text))
    bounds = sorted([0, unchecked, len(text), *(c for c in cuts if c <= len(text))])
    matcher = StopStringMatcher(stops, include)
    emitted, hit = "", (-1, 0)
    for start, end in zip(bounds, bounds[1:], strict=False):
        piece = text[start:end]
        if end <= unchecked:
            emitted += matcher.push_unchecked(piece)
            continue
        out, stop_index, chars_to_stop = matcher.push(piece)
        emitted += out
        if stop_index >= 0:
            hit = (stop_index, start + chars_to_stop)
            break
    else:
        emitted += matcher.finish()
    candidates = []  # (end, -len, index, start) of each stop's first occurrence ending past `unchecked`
    for index, stop in enumerate(stops):
        found = text.find(stop, max(0, unchecked - len(stop) + 1))
        if found >= 0:
            candidates.append((found + len(stop), -len(stop), index, found))
    if not candidates:
        assert (emitted, hit) == (text, (-1, 0))
        return
    end, _, index, found = min(candidates)
    assert hit == (index, end)
    assert emitted == text[:end if include else found]


def vllm_rule(tokenizer: Tokenizer, ids: Sequence[int], stops: Sequence[str], min_tokens: int,
              include: bool) -> tuple[str, int, int]:
    """(text, stop index or -1, ids accounted) by vLLM's rule: the earliest-ending stop whose end
    lies past the text of the first min_tokens ids; the ids up to the one completing it."""
    full = tokenizer.decode(list(ids))
    unchecked = len(tokenizer.decode(list(ids[:min_tokens])).rstrip(REPLACEMENT_CHAR))
    best: tuple[int, int, int, int] | None = None  # (end, -len, index, start)
    for index, stop in enumerate(stops):
        start = full.find(stop, max(0, unchecked - len(stop) + 1))
        if start >= 0 and (best is None or (start + len(stop), -len(stop), index) < best[:3]):
            best = (start + len(stop), -len(stop), index, start)
    if best is None:
        return full, -1, len(ids)
    end, _, index, start = best
    reaching = next(t for t in range(1, len(ids) + 1)
                    if len(tokenizer.decode(list(ids[:t])).rstrip(REPLACEMENT_CHAR)) >= end)
    return full[:end if include else start], index, reaching


def run_stream(identity: common_pb2.TokenizerIdentity, ids: list[int], stops: list[str], min_tokens: int,
               chunk: int | list[int], columns: bool = False, include: bool = False) -> tuple[str, int, int]:
    """(text, stop index or -1, ids accounted) of one sequence fed `chunk` ids a frame (or frames of
    the sizes a list gives)."""
    stream = DetokenizeStream()
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(
        sequence_id="s", tokenizer=identity, skip_special_tokens=True, stop=stops, min_tokens=min_tokens,
        include_stop_str_in_output=include, handle=1 if columns else 0)]))
    sizes = chunk if isinstance(chunk, list) else [chunk] * -(-len(ids) // chunk)
    text, num_tokens, start = "", 0, 0
    for size in sizes:
        part, start = ids[start:start + size], start + size
        last = start >= len(ids)
        if columns:
            frame = pb.DetokenizeFrame(columns=pb.TokenColumns(
                handles=pack_int32([1]), num_tokens=pack_int32([len(part)]), token_ids=pack_int32(part),
                finished_handles=pack_int32([1] if last else [])))
        else:
            frame = pb.DetokenizeFrame(tokens=[pb.SequenceTokenIds(sequence_id="s", token_ids=pack_int32(part),
                                                                   finished=last)])
        reply = stream.apply(frame)
        for delta in reply.deltas:
            assert not delta.error, delta.error
            text += delta.text
            num_tokens += delta.num_tokens
            if delta.finished:
                return text, delta.stop_index, num_tokens
        if reply.columns.handles:
            offset = 0
            for handle, length, count in zip(unpack_int32(reply.columns.handles).tolist(),
                                             unpack_int32(reply.columns.text_lengths).tolist(),
                                             unpack_int32(reply.columns.num_tokens).tolist(), strict=True):
                assert handle == 1
                text += reply.columns.text[offset:offset + length].decode("utf-8")
                num_tokens += count
                offset += length
    raise AssertionError("the sequence never finished")


@pytest.fixture(scope="module")
def smollm2_identity(smollm2_dir: Path) -> common_pb2.TokenizerIdentity:
    return tokenizer_identity(smollm2_dir)


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, common_pb2.TokenizerIdentity]:
    """A SentencePiece-style tokenizer: the generic (window) detokenizer's path."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator([TEXT] * 3, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    directory = tmp_path_factory.mktemp("metaspace-min-tokens")
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer, tokenizer_identity(directory)


CASES = [(["e"], 0), (["e"], 1), (["e"], 3), (["e"], 5), (["the"], 2), (["the", "T"], 4), (["went home"], 9),
         (["the end"], 12), (["never there"], 3), ([" rest"], 99)]


@pytest.mark.parametrize("stops,min_tokens", CASES)
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("path", ["byte-level entries", "column rows", "window detokenizer"])
def test_stops_count_only_past_the_first_min_tokens_ids(smollm2, smollm2_identity, metaspace, stops, min_tokens,
                                                       chunk, path):
    tokenizer, identity = metaspace if path == "window detokenizer" else (smollm2, smollm2_identity)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    expected = vllm_rule(tokenizer, ids, stops, min_tokens, include=False)
    assert run_stream(identity, ids, stops, min_tokens, chunk, columns=path == "column rows") == expected


def test_include_stop_str_in_output_with_min_tokens(smollm2, smollm2_identity):
    ids = smollm2.encode(TEXT, add_special_tokens=False).ids
    for columns in (False, True):
        got = run_stream(smollm2_identity, ids, ["e"], 4, 1, columns, include=True)
        assert got == vllm_rule(smollm2, ids, ["e"], 4, include=True)
        assert got[1] == 0 and got[0].endswith("e") and len(got[0]) > len(smollm2.decode(ids[:4]))


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, common_pb2.TokenizerIdentity]:
    """A Llama-2-style tokenizer (SentencePiece pieces, <0xNN> byte fallback): the window
    detokenizer holds an open byte run's text until a later id ends the run."""
    tokenizer = llama2_style()
    directory = tmp_path_factory.mktemp("byte-fallback")
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer, tokenizer_identity(directory)


@pytest.mark.parametrize("chunks", [[1] * 8, [8], [2, 3, 3], [3, 2, 3], [4, 4]])
def test_text_the_detokenizer_held_past_min_tokens_stays_unchecked(byte_fallback, chunks):
    """Review finding: the bytes of "€" are ids 2-4 of 'Hello€ ok' with min_tokens 4; the window
    detokenizer lets "€" out only with the next id, past min_tokens, and that text was checked."""
    tokenizer, identity = byte_fallback
    hello = tokenizer.encode("Hello", add_special_tokens=False).ids
    euro = [tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in "€".encode()]
    ok = tokenizer.encode(" ok", add_special_tokens=False).ids
    ids = hello + euro + ok
    min_tokens = len(hello) + len(euro)
    assert tokenizer.decode(ids[:min_tokens]) == "Hello€" and len(ids) == sum(chunks)
    for stops in (["€"], ["llo€"]):
        expected = vllm_rule(tokenizer, ids, stops, min_tokens, include=False)
        assert expected == (tokenizer.decode(ids), -1, len(ids))
        assert run_stream(identity, ids, stops, min_tokens, chunks) == expected
    # A stop that starts in that held text and ends after it still counts.
    stops = ["€ ok"] if tokenizer.decode(ids).endswith("€ ok") else ["€  ok"]
    assert run_stream(identity, ids, stops, min_tokens, chunks) == vllm_rule(
        tokenizer, ids, stops, min_tokens, include=False)


def test_an_output_no_longer_than_min_tokens_is_never_checked(byte_fallback, smollm2, smollm2_identity):
    """vLLM checks stop strings only once the output is longer than min_tokens: text the finish
    flushes (a held byte run, an unfinished character) is not checked either."""
    tokenizer, identity = byte_fallback
    ids = tokenizer.encode("Hello", add_special_tokens=False).ids + [
        tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in "€".encode()]
    assert run_stream(identity, ids, ["€"], len(ids), [1] * len(ids)) == ("Hello€", -1, len(ids))
    # SmolLM2: the first byte of "€" alone ends the output; the finish flushes it as U+FFFD.
    euro_first_byte = [i for i in range(smollm2.get_vocab_size()) if smollm2.id_to_token(i) == "â"]
    if euro_first_byte:
        ids = smollm2.encode("Hi", add_special_tokens=False).ids + euro_first_byte[:1]
        got = run_stream(smollm2_identity, ids, [REPLACEMENT_CHAR], len(ids), [1] * len(ids))
        assert got[1] == -1 and got[2] == len(ids)

