"""Token rendering for logprobs: each id's string and raw bytes (OpenAI's `token` and `bytes`).

Beside the text flow, not in it: stream.py renders a SequenceTokenIds' render_token_ids into
its TextDelta.rendered, servicer.py answers the RenderTokens RPC; both go through here.
"""

from __future__ import annotations

import functools

import numpy as np

from detok_worker.token_bytes import TokenizerDecoding
from tokenwire.packing import pack_int32
from tokenwire.v1 import detok_worker_pb2

# Decoders drop the leading space of the first token they see (Metaspace, Strip): rendering
# each token after this one keeps "▁Hello" as " Hello", as it reads inside a text.
_ANCHOR = "x"


def token_text(data: bytes) -> str:
    """The token's string when its bytes are whole UTF-8 characters, else "bytes:" and \\xNN
    escapes (OpenAI's convention; vLLM shows U+FFFD there, with its bytes 239 191 189): a piece
    of a character never shows as U+FFFD, and the token's own bytes go out beside it."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


class TokenRenderer:
    """id -> (string, bytes) for one tokenizer; independent of skip_special_tokens, since a
    logprob names the token the model picked, special or not."""

    def __init__(self, decoding: TokenizerDecoding) -> None:
        self.vocab_size = decoding.vocab_size
        self._decoding = decoding
        self._pieces: list[bytes] | None = None
        self._texts: list[str] | None = None
        self._known: np.ndarray  # [vocab_size] bool: ids the tokenizer has
        self._anchor_text = _ANCHOR  # how the generic path's decoder reads _ANCHOR alone
        if decoding.token_bytes is not None:
            # Byte-level: every id's bytes are already in the unskipped table.
            table = decoding.token_bytes[False]
            self._pieces = table.pieces
            self._texts = [token_text(piece) for piece in table.pieces]
            self._known = table.known_ids
        else:
            assert decoding.tokenizer is not None
            self._known = np.array([decoding.tokenizer.id_to_token(i) is not None
                                    for i in range(self.vocab_size)], dtype=bool)
            if decoding.tokenizer.decoder is not None:
                self._anchor_text = decoding.tokenizer.decoder.decode([_ANCHOR])
        self._generic: dict[int, tuple[str, bytes]] = {}  # filled as ids are asked for

    def check_ids(self, token_ids: np.ndarray) -> None:
        """Raises ValueError naming the first id this tokenizer does not have."""
        if not token_ids.size:
            return
        ids = token_ids.astype(np.int64, copy=False)
        bad = (ids < 0) | (ids >= self.vocab_size)
        bad[~bad] = ~self._known[ids[~bad]]
        if bad.any():
            first = int(ids[np.argmax(bad)])
            raise ValueError(f"token id {first} is not in the tokenizer's vocabulary (size {self.vocab_size})")

    def _generic_token(self, token_id: int) -> tuple[str, bytes]:
        rendered = self._generic.get(token_id)
        if rendered is not None:
            return rendered
        tokenizer = self._decoding.tokenizer
        assert tokenizer is not None
        token = tokenizer.id_to_token(token_id)
        if token_id in self._decoding.byte_fallback_ids:
            data = bytes([int(token[3:5], 16)])  # "<0xE2>" stands for the byte 0xE2
            rendered = (token_text(data), data)
        else:
            text = token
            if tokenizer.decoder is not None:
                anchor = self._anchor_text
                in_context = tokenizer.decoder.decode([_ANCHOR, token])
                text = (in_context[len(anchor):] if in_context.startswith(anchor)
                        else tokenizer.decode([token_id], skip_special_tokens=False))
            rendered = (text, text.encode("utf-8"))
        self._generic[token_id] = rendered
        return rendered

    def render_into(self, target: detok_worker_pb2.RenderedTokens, token_ids: np.ndarray) -> None:
        """Appends the (checked) ids [n] to target, continuing its offsets."""
        ids = token_ids.tolist()
        if self._pieces is not None and self._texts is not None:
            texts = [self._texts[i] for i in ids]
            pieces = [self._pieces[i] for i in ids]
        else:
            rendered = [self._generic_token(i) for i in ids]
            texts = [text for text, _ in rendered]
            pieces = [data for _, data in rendered]
        start = len(target.data)
        ends = np.cumsum([len(piece) for piece in pieces], dtype=np.int64) + start  # [n]
        target.text.extend(texts)
        target.data += b"".join(pieces)
        target.offsets += pack_int32(ends) if target.offsets else pack_int32([start, *ends.tolist()])

    def render(self, token_ids: np.ndarray) -> detok_worker_pb2.RenderedTokens:
        self.check_ids(token_ids)
        rendered = detok_worker_pb2.RenderedTokens()
        self.render_into(rendered, token_ids)
        return rendered


@functools.lru_cache(maxsize=8)
def renderer_for(decoding: TokenizerDecoding) -> TokenRenderer:
    """One renderer per tokenizer, built on first use (its tables cost ~0.1 s per 100k ids)."""
    return TokenRenderer(decoding)
