"""Token rendering for logprobs (render.py): OpenAI's `token` and `bytes` per id, in a
TextDelta of the frame loop and on their own.

Partial-character tokens, special tokens, SentencePiece byte-fallback and '▁' pieces.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from detok_worker.incremental import new_detokenizer
from detok_worker.render import TokenRenderer, renderer_for, token_text
from detok_worker.stream import DetokenizeStream
from detok_worker.token_bytes import TokenizerDecoding
from tests import detok_tokenizers
from tokenwire.packing import pack_int32, unpack_int32
from tokenwire.v1 import common_pb2
from tokenwire.v1 import detok_worker_pb2 as pb


def unpack(rendered: pb.RenderedTokens) -> list[tuple[str, bytes]]:
    offsets = unpack_int32(rendered.offsets).tolist()
    assert len(offsets) == len(rendered.text) + 1 and offsets[0] == 0 and offsets[-1] == len(rendered.data)
    return [(text, rendered.data[a:b]) for text, a, b in zip(rendered.text, offsets[:-1], offsets[1:], strict=True)]


def render(renderer: TokenRenderer, ids: list[int]) -> list[tuple[str, bytes]]:
    return unpack(renderer.render(np.array(ids, dtype="<i4")))


def test_token_text_escapes_partial_characters() -> None:
    assert token_text("é".encode()) == "é"
    assert token_text(b"\xe2\x82") == "bytes:\\xe2\\x82"
    assert token_text(b" \xf0") == "bytes:\\x20\\xf0"
    assert token_text(b"") == ""


def test_byte_level_tokens(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding) -> None:
    renderer = renderer_for(smollm2_decoding)
    hello = smollm2.encode(" Hello").ids
    emoji = smollm2.encode("🙂").ids  # one 4-byte character over several tokens
    im_end = smollm2.token_to_id("<|im_end|>")
    rendered = render(renderer, [*hello, *emoji, im_end])
    assert rendered[0] == (" Hello", b" Hello")
    emoji_parts = rendered[len(hello):len(hello) + len(emoji)]
    assert b"".join(data for _, data in emoji_parts) == "🙂".encode()
    assert len(emoji_parts) > 1 and all(text.startswith("bytes:\\x") for text, _ in emoji_parts)
    assert all("\ufffd" not in text for text, _ in rendered)
    # Special tokens render as themselves, whatever a sequence's skip_special_tokens.
    assert rendered[-1] == ("<|im_end|>", b"<|im_end|>")


def test_tiktoken_tokens() -> None:
    encoding = detok_tokenizers.cl100k()
    renderer = TokenRenderer(TokenizerDecoding(encoding))
    ids = encoding.encode("naïve 日本<|endoftext|>", allowed_special="all")
    rendered = render(renderer, ids)
    assert [data for _, data in rendered] == [encoding.decode_single_token_bytes(i) for i in ids]
    assert rendered[-1] == ("<|endoftext|>", b"<|endoftext|>")
    for text, data in rendered:
        assert text == token_text(data)
    with pytest.raises(ValueError, match="token id 100256 is not in the tokenizer's vocabulary"):
        renderer.render(np.array([100256], dtype="<i4"))  # a gap in cl100k's id range


def test_sentencepiece_byte_fallback_and_space_marker() -> None:
    tokenizer = detok_tokenizers.llama2_style()
    renderer = TokenRenderer(TokenizerDecoding(tokenizer))
    hello = tokenizer.token_to_id("▁Hello")
    assert hello is not None
    ids = [hello, tokenizer.token_to_id("<0xE2>"), tokenizer.token_to_id("<0x41>"), tokenizer.token_to_id("<s>"),
           tokenizer.token_to_id("o")]
    assert render(renderer, ids) == [
        (" Hello", b" Hello"),  # '▁' reads as the space it stands for, not stripped
        ("bytes:\\xe2", b"\xe2"),  # a lone lead byte: escaped, never U+FFFD
        ("A", b"A"),
        ("<s>", b"<s>"),
        ("o", b"o"),
    ]


def test_generic_metaspace_and_wordpiece() -> None:
    metaspace = detok_tokenizers.metaspace_plain()
    renderer = TokenRenderer(TokenizerDecoding(metaspace))
    assert render(renderer, [metaspace.token_to_id("▁Hello")]) == [(" Hello", b" Hello")]
    wordpiece = detok_tokenizers.wordpiece()
    renderer = TokenRenderer(TokenizerDecoding(wordpiece))
    continuation = next(t for t in wordpiece.get_vocab() if t.startswith("##") and len(t) > 3)
    assert render(renderer, [wordpiece.token_to_id(continuation)]) == [(continuation[2:], continuation[2:].encode())]


def test_rendered_in_the_frame_loop(smollm2: Tokenizer, smollm2_decoding: TokenizerDecoding) -> None:
    """render_token_ids of an entry come back in its sequence's delta, in order, even in a frame
    whose ids produced no text yet (half a character); num_tokens counts the ids it covers."""
    stream = DetokenizeStream(open_decoding=lambda _identity: smollm2_decoding)
    identity = common_pb2.TokenizerIdentity(path="smollm2")
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="a", tokenizer=identity, stop=["zz"]),
                                           pb.OpenSequence(sequence_id="b", tokenizer=identity)]))
    emoji = smollm2.encode("🙂").ids
    top = smollm2.encode(" the a").ids
    reply = stream.apply(pb.DetokenizeFrame(tokens=[
        pb.SequenceTokenIds(sequence_id="a", token_ids=pack_int32(emoji[:1]), render_token_ids=pack_int32([emoji[0], *top])),
        pb.SequenceTokenIds(sequence_id="b", token_ids=pack_int32(top)),
    ]))
    deltas = {d.sequence_id: d for d in reply.deltas}
    assert (deltas["a"].text, deltas["a"].num_tokens, deltas["a"].finished) == ("", 1, False)
    assert [t for t, _ in unpack(deltas["a"].rendered)] == [token_text(smollm2_decoding.token_bytes[False].pieces[i])
                                                            for i in [emoji[0], *top]]
    assert (deltas["b"].text, deltas["b"].num_tokens, deltas["b"].HasField("rendered")) == (" the a", len(top), False)
    # Two entries of one sequence in one frame fold into one delta: texts and renders appended.
    reply = stream.apply(pb.DetokenizeFrame(tokens=[
        pb.SequenceTokenIds(sequence_id="a", token_ids=pack_int32(emoji[1:]), render_token_ids=pack_int32(emoji[1:])),
        pb.SequenceTokenIds(sequence_id="a", token_ids=pack_int32(top), render_token_ids=pack_int32(top[:1]),
                            finished=True),
    ]))
    (delta,) = reply.deltas
    assert (delta.text, delta.finished, delta.num_tokens) == ("🙂 the a", True, len(emoji) - 1 + len(top))
    pieces = smollm2_decoding.token_bytes[False].pieces
    assert [data for _, data in unpack(delta.rendered)] == [pieces[i] for i in [*emoji[1:], top[0]]]


def test_bad_render_ids_fail_only_their_sequence(smollm2_decoding: TokenizerDecoding) -> None:
    stream = DetokenizeStream(open_decoding=lambda _identity: smollm2_decoding)
    identity = common_pb2.TokenizerIdentity(path="smollm2")
    stream.apply(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id=s, tokenizer=identity) for s in "abc"]))
    reply = stream.apply(pb.DetokenizeFrame(tokens=[
        pb.SequenceTokenIds(sequence_id="a", token_ids=pack_int32([100]), render_token_ids=pack_int32([100, 49152])),
        pb.SequenceTokenIds(sequence_id="b", token_ids=pack_int32([100]), render_token_ids=b"\x01\x02"),
        pb.SequenceTokenIds(sequence_id="c", token_ids=pack_int32([100])),
    ]))
    deltas = {d.sequence_id: d for d in reply.deltas}
    assert "49152" in deltas["a"].error and deltas["a"].finished
    assert "multiple of 4" in deltas["b"].error
    assert not deltas["c"].error and deltas["c"].text
    assert stream.live_sequence_ids == ["c"]


def with_id_gap(tokenizer: Tokenizer, gap: int) -> tuple[Tokenizer, int]:
    """The tokenizer with its highest model-vocab piece moved gap ids up, and that piece's id.
    (tokenizers ignores the ids of added tokens that are not in the model vocab, so a gap in
    the id range has to come from the model vocab, as in a tokenizer.json whose vocab skips ids.)"""
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    last = max(vocab, key=vocab.get)
    vocab[last] += gap
    return Tokenizer.from_str(json.dumps(spec)), vocab[last]


@pytest.mark.parametrize("name", ["llama2_style", "smollm2"])
def test_ids_past_a_gap_in_the_vocabulary(request: pytest.FixtureRequest, name: str) -> None:
    """The vocabulary's range is max id + 1 (as the model worker's num_token_ids masks), not its
    count of tokens: the ids above a gap are the tokenizer's, the ids in it are not."""
    base = detok_tokenizers.llama2_style() if name == "llama2_style" else request.getfixturevalue("smollm2")
    tokenizer, high = with_id_gap(base, 20)
    decoding = TokenizerDecoding(tokenizer)
    renderer = TokenRenderer(decoding)
    # The same piece as at its id in the tokenizer without the gap.
    assert render(renderer, [high]) == render(TokenRenderer(TokenizerDecoding(base)), [high - 20])
    for skip in (False, True):
        detokenizer = new_detokenizer(decoding, skip)
        assert detokenizer.feed([high]) + detokenizer.finish() == tokenizer.decode([high], skip_special_tokens=skip)
    assert decoding.vocab_size == high + 1 > tokenizer.get_vocab_size(with_added_tokens=True)
    in_gap = high - 1
    assert tokenizer.id_to_token(in_gap) is None
    with pytest.raises(ValueError, match=f"token id {in_gap} is not in the tokenizer's vocabulary"):
        renderer.render(np.array([in_gap], dtype="<i4"))
    with pytest.raises(ValueError, match=f"token id {high + 1} is not in the tokenizer's vocabulary"):
        renderer.render(np.array([high + 1], dtype="<i4"))
