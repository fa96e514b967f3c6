"""Incremental detokenization equals tokenizers' one-shot decode, chunk by chunk.

Covers token_bytes.py and incremental.py on the real SmolLM2 byte-level tokenizer and on
small non-byte-level tokenizers trained here offline (the generic path).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from detok_worker.incremental import ByteLevelDetokenizer, WindowDetokenizer, new_detokenizer
from detok_worker.token_bytes import TokenBytes, TokenizerDecoding
from tests.detok_tokenizers import finished_text
from tokenwire.byte_level import is_byte_level, unicode_to_bytes

SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus München: Straße, Größe, naïve café, Ærøskøbing.",
    "Привет, как дела? Всё хорошо.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 🙂👍🏽 🇫🇷 👨‍👩‍👧‍👦 ✨ — family and flags 🏳️‍🌈",
    "Arabic مرحبا بالعالم and Hebrew שלום עולם, Hindi नमस्ते दुनिया.",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # ∑ ∫ √\n",
]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def feed_in_chunks(detokenizer: ByteLevelDetokenizer | WindowDetokenizer, ids: Sequence[int],
                   chunk_sizes: Sequence[int]) -> list[str]:
    deltas = []
    start = 0
    sizes = iter(chunk_sizes)
    while start < len(ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.feed(ids[start:start + size]))
        start += size
    deltas.append(detokenizer.finish())
    return deltas


def assert_deltas_match(deltas: list[str], expected: str) -> None:
    assert "".join(deltas) == expected
    # No delta ever ends inside a character: every running concatenation is a prefix of the
    # final text, so no U+FFFD stood in for bytes still to come.
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)


def test_smollm2_is_byte_level_and_uses_tiktoken(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding) -> None:
    assert is_byte_level(smollm2)
    assert smollm2_decoding.token_bytes is not None
    assert all(table.uses_tiktoken for table in smollm2_decoding.token_bytes.values())


def test_every_token_alone_decodes_like_tokenizers(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding) -> None:
    assert smollm2_decoding.token_bytes is not None
    for skip in (False, True):
        table = smollm2_decoding.token_bytes[skip]
        for token_id, piece in enumerate(table.pieces):
            assert piece.decode("utf-8", "replace") == smollm2.decode([token_id], skip_special_tokens=skip)


@st.composite
def token_ids_and_chunks(draw: st.DrawFn, vocab_size: int, special_ids: list[int],
                         byte_ids: list[int]) -> tuple[list[int], list[int]]:
    """Ids from the whole vocabulary, special tokens and single-byte tokens (lone lead and
    continuation bytes included, so invalid UTF-8 is common), cut into random chunks."""
    one_id = st.one_of(st.integers(0, vocab_size - 1), st.sampled_from(special_ids), st.sampled_from(byte_ids))
    ids = draw(st.lists(one_id, max_size=40))
    chunks = draw(st.lists(st.integers(1, 6), max_size=40))
    return ids, chunks


def byte_token_ids(tokenizer: Tokenizer) -> dict[int, int]:
    """byte -> id of the token that is just that byte (SmolLM2 lacks a few, e.g. 0x04, 0xF1)."""
    char_for_byte = {b: c for c, b in unicode_to_bytes().items()}
    ids = {b: tokenizer.token_to_id(char_for_byte[b]) for b in range(256)}
    found = {b: i for b, i in ids.items() if i is not None}
    # continuation bytes and most lead bytes (0xC0/0xC1 never occur in UTF-8)
    assert all(b in found for b in [*range(0x80, 0xC0), *range(0xC2, 0xF1)])
    return found


def test_random_ids_concatenate_to_one_shot_decode(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding) -> None:
    special_ids = [i for i, t in smollm2.get_added_tokens_decoder().items() if t.special]
    strategy = token_ids_and_chunks(smollm2.get_vocab_size(), special_ids, sorted(byte_token_ids(smollm2).values()))

    @SETTINGS
    @given(case=strategy, skip=st.booleans())
    def check(case: tuple[list[int], list[int]], skip: bool) -> None:
        ids, chunks = case
        deltas = feed_in_chunks(new_detokenizer(smollm2_decoding, skip), ids, chunks)
        assert_deltas_match(deltas, finished_text(smollm2_decoding, smollm2.decode(ids, skip_special_tokens=skip),
                                                  ids, skip))

    check()


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_real_text_token_by_token(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding, text: str) -> None:
    ids = smollm2.encode(text).ids
    deltas = feed_in_chunks(new_detokenizer(smollm2_decoding, True), ids, [1] * len(ids))
    assert_deltas_match(deltas, text)
    assert "\ufffd" not in "".join(deltas)


def test_multibyte_character_is_held_until_complete(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding) -> None:
    byte_ids = byte_token_ids(smollm2)
    detokenizer = new_detokenizer(smollm2_decoding, False)
    euro = [byte_ids[b] for b in "€".encode()]
    assert detokenizer.feed(euro[:1]) == ""
    assert detokenizer.feed(euro[1:2]) == ""
    assert detokenizer.feed(euro[2:]) == "€"
    assert detokenizer.feed(euro[:2]) == ""
    # An output that ends inside a character drops it, as vLLM's detokenizers do (tokenizers'
    # from_utf8_lossy would end it in U+FFFD: review 102).
    assert detokenizer.finish() == ""


def test_added_tokens_outside_the_byte_alphabet(smollm2_dir: Path) -> None:
    """An added token with a char outside GPT-2's byte alphabet decodes as its own UTF-8;
    one whose bytes equal a vocab token's forces the pure-Python table (tiktoken cannot
    hold duplicate bytes)."""
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<|tool call|>", special=True), AddedToken("<|ü|>", special=True)])
    tokenizer.add_tokens([AddedToken(" Hello", special=False, normalized=False)])
    decoding = TokenizerDecoding(tokenizer)
    assert decoding.token_bytes is not None
    assert not decoding.token_bytes[False].uses_tiktoken
    base = tokenizer.get_vocab_size() - 3
    hello = tokenizer.encode("Hi there, how are you?").ids
    for ids in ([base, *hello, base + 1, base + 2, *hello], [base + 2, base + 1, base]):
        for skip in (False, True):
            deltas = feed_in_chunks(new_detokenizer(decoding, skip), ids, [1, 2, 3] * 10)
            assert_deltas_match(deltas, tokenizer.decode(ids, skip_special_tokens=skip))


@pytest.mark.parametrize("bad_id", [-1, 49152, 2**31 - 1])
def test_out_of_vocab_id_is_a_clear_value_error(smollm2_decoding: TokenizerDecoding, bad_id: int) -> None:
    detokenizer = new_detokenizer(smollm2_decoding, True)
    with pytest.raises(ValueError, match=f"token id {bad_id} is not in the tokenizer's vocabulary"):
        detokenizer.feed([100, bad_id])


def test_token_bytes_frame_checks() -> None:
    table = TokenBytes([b"a", None, b"\xc3", b"\xa9", b""])
    assert not table.uses_tiktoken or table.vocab_size == 5
    assert table.ids_are_valid(np.array([0, 2, 3, 4], dtype="<i4"))
    for bad in ([1], [5], [-1]):
        ids = np.array(bad, dtype="<i4")
        assert not table.ids_are_valid(ids)
        with pytest.raises(ValueError):
            table.check_ids(ids)
    assert table.decode(np.array([0, 4, 2, 3, 4], dtype="<i4")) == b"a\xc3\xa9"


# --- the generic path: non-byte-level tokenizers trained here, nothing downloaded ---

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Le café est très bon, n'est-ce pas?",
    "日本語のテキストも少し。",
    "Emoji 🙂 and ✨ sparkle!",
    "Hello world, hello tokens, hello streaming text.",
] * 3


@pytest.fixture(scope="module")
def llama_style() -> Tokenizer:
    """SentencePiece-like BPE: '▁' for spaces, <0xNN> byte-fallback pieces, Llama's decoder."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tokenizer.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.add_tokens([AddedToken(f"<0x{b:02X}>", special=False, normalized=False) for b in range(256)])
    return tokenizer


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return tokenizer


def test_generic_tokenizers_are_not_byte_level(llama_style: Tokenizer, metaspace: Tokenizer) -> None:
    for tokenizer in (llama_style, metaspace):
        assert not is_byte_level(tokenizer)
        assert isinstance(new_detokenizer(TokenizerDecoding(tokenizer), True), WindowDetokenizer)


@st.composite
def valid_text_ids(draw: st.DrawFn, tokenizer: Tokenizer) -> list[int]:
    """Random pieces of the vocabulary and special tokens, with whole characters spelled as
    <0xNN> byte pieces in between: any order, but always valid UTF-8."""
    vocab = tokenizer.get_vocab_size()
    byte_piece = {b: tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    piece = st.integers(0, vocab - 1).filter(lambda i: not tokenizer.id_to_token(i).startswith("<0x"))
    char_as_bytes = st.characters(codec="utf-8").map(lambda c: [byte_piece[b] for b in c.encode()])
    if byte_piece[0] is None:
        char_as_bytes = st.just([])
    units = draw(st.lists(st.one_of(piece.map(lambda i: [i]), char_as_bytes), max_size=30))
    return [i for unit in units for i in unit]


@pytest.mark.parametrize("name", ["llama_style", "metaspace"])
def test_generic_random_valid_ids(request: pytest.FixtureRequest, name: str) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    decoding = TokenizerDecoding(tokenizer)

    @SETTINGS
    @given(ids=valid_text_ids(tokenizer), chunks=st.lists(st.integers(1, 5), max_size=30), skip=st.booleans())
    def check(ids: list[int], chunks: list[int], skip: bool) -> None:
        deltas = feed_in_chunks(new_detokenizer(decoding, skip), ids, chunks)
        assert_deltas_match(deltas, tokenizer.decode(ids, skip_special_tokens=skip))

    check()


@pytest.mark.parametrize("text", SAMPLE_TEXTS[:5])
def test_generic_real_text_token_by_token(llama_style: Tokenizer, text: str) -> None:
    ids = llama_style.encode(text).ids
    deltas = feed_in_chunks(new_detokenizer(TokenizerDecoding(llama_style), False), ids, [1] * len(ids))
    assert_deltas_match(deltas, llama_style.decode(ids, skip_special_tokens=False))


def test_generic_byte_fallback_holds_partial_characters(llama_style: Tokenizer) -> None:
    detokenizer = new_detokenizer(TokenizerDecoding(llama_style), True)
    euro = [llama_style.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    hello = llama_style.encode("Hello").ids
    assert detokenizer.feed(hello) == "Hello"
    assert detokenizer.feed(euro[:1]) == ""
    assert detokenizer.feed(euro[1:2]) == ""
    # Complete, but the byte run is still open: a bad byte next would turn all of it to U+FFFD.
    assert detokenizer.feed(euro[2:]) == ""
    assert detokenizer.feed(hello) == "€ Hello"
    assert detokenizer.feed(euro) == ""
    assert detokenizer.finish() == "€"


def test_generic_byte_run_made_invalid_by_a_later_byte(llama_style: Tokenizer) -> None:
    """ByteFallback turns a whole run of byte pieces into U+FFFD, one per byte, when any of
    it is invalid UTF-8, so a finished "€" must not be sent before the run ends."""
    byte = {b: llama_style.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    hello = llama_style.encode("Hello").ids
    ids = [*hello, byte[0xE2], byte[0x82], byte[0xAC], byte[0x80], *hello]
    expected = llama_style.decode(ids)
    assert "\ufffd" * 4 in expected
    deltas = feed_in_chunks(new_detokenizer(TokenizerDecoding(llama_style), True), ids, [1] * len(ids))
    assert_deltas_match(deltas, expected)


class CountingDecodes:
    """The tokenizer's decode, counted."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def decode(self, ids: list[int], **kwargs: bool) -> str:
        self.calls += 1
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("run", ["invalid", "valid", "ascii", "mixed"])
def test_generic_long_byte_run_decodes_once_per_run(llama_style: Tokenizer, run: str) -> None:
    """Nothing of an open byte run is emitted, so its window is not decoded until the run ends:
    a decode per byte of a growing window made a long run quadratic."""
    byte = {b: llama_style.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    data = {"invalid": b"\xe2" * 500, "valid": "€".encode() * 167, "ascii": b"A" * 500,
            "mixed": ("€".encode() + b"\x80") * 125}[run]
    hello = llama_style.encode("Hello").ids
    decoding = TokenizerDecoding(llama_style)
    counting = CountingDecodes(llama_style)
    decoding.tokenizer = counting  # type: ignore[assignment]
    detokenizer = new_detokenizer(decoding, True)
    deltas = [detokenizer.feed(hello)]
    counting.calls = 0
    deltas += [detokenizer.feed([byte[b]]) for b in data]
    assert counting.calls <= 1, f"{counting.calls} decodes over a run of {len(data)} byte pieces"
    deltas += [detokenizer.feed(hello), detokenizer.feed([byte[b] for b in data]), detokenizer.feed(hello)]
    deltas.append(detokenizer.finish())
    ids = [*hello, *[byte[b] for b in data], *hello, *[byte[b] for b in data], *hello]
    assert_deltas_match(deltas, llama_style.decode(ids))


def test_generic_prompt_tail_keeps_the_leading_space(metaspace: Tokenizer) -> None:
    """Metaspace drops the space of the first piece it decodes; with the prompt's tail as
    context the first generated word keeps it, as in decode(prompt + output)."""
    prompt = metaspace.encode("Hello tokens,").ids
    output = metaspace.encode("hello world").ids
    decoding = TokenizerDecoding(metaspace)
    deltas = feed_in_chunks(new_detokenizer(decoding, True, prompt[-3:]), output, [1] * len(output))
    full = metaspace.decode(prompt[-3:] + output)
    assert "".join(deltas) == full[len(metaspace.decode(prompt[-3:])):]
    assert "".join(deltas).startswith(" hello")
    assert "".join(feed_in_chunks(new_detokenizer(decoding, True), output, [1] * 9)) == "hello world"


def test_generic_prompt_tail_ending_inside_a_character(llama_style: Tokenizer) -> None:
    """A token-id prompt ending in 2 of the 3 bytes of "€", and an output that starts with the
    third: the output reads as its own ids decode ("\ufffd world"), as on the byte-level path.
    Counting the tail's two bytes (two U+FFFD) as emitted text lost the output's first two
    characters once the third byte made them one "€"."""
    byte = {b: llama_style.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    hello, world = llama_style.encode("Hello").ids, llama_style.encode("world").ids
    output = [byte[0xAC], *world]
    for tail in ([*hello, byte[0xE2], byte[0x82]], [byte[0xE2], byte[0x82]]):
        for chunks in ([1] * len(output), [len(output)]):
            deltas = feed_in_chunks(new_detokenizer(TokenizerDecoding(llama_style), True, tail), output, chunks)
            assert "".join(deltas) == llama_style.decode(output) == "\ufffd world", (tail, chunks, deltas)
    # A tail of nothing but the open run: the output still does not start the text, so its first
    # word keeps the space Llama's decoder strips from a text's first piece.
    deltas = feed_in_chunks(new_detokenizer(TokenizerDecoding(llama_style), True, [byte[0xE2], byte[0x82]]),
                            hello, [1] * len(hello))
    assert "".join(deltas) == " Hello"
    # A tail whose byte run is a whole character stays context: the output's bytes join its run.
    euro = [byte[b] for b in "€".encode()]
    deltas = feed_in_chunks(new_detokenizer(TokenizerDecoding(llama_style), True, [*hello, *euro]),
                            [*euro, *world], [1] * (3 + len(world)))
    assert "".join(deltas) == "€ world"


def test_generic_out_of_vocab_id(metaspace: Tokenizer) -> None:
    detokenizer = new_detokenizer(TokenizerDecoding(metaspace), True)
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        detokenizer.feed([metaspace.get_vocab_size()])
