"""GPT-2 style byte-level BPE: the alphabet that spells every byte as one printable char.

The detok worker builds its byte tables from it and the gateway renders logprob token bytes
with it, so both read a token's bytes exactly as tokenizers' ByteLevel decoder does.
"""

from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the char a byte-level BPE vocab uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_values = list(printable)
    code_points = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            code_points.append(256 + shift)
            shift += 1
    return {chr(cp): b for b, cp in zip(byte_values, code_points, strict=True)}


def is_byte_level(tokenizer: Tokenizer) -> bool:
    """Only a plain ByteLevel decoder maps tokens to bytes context-free; anything else
    (Metaspace, WordPiece, a Sequence with Strip/Replace...) goes the generic way."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    return decoder.get("type") == "ByteLevel"


def token_piece_bytes(token: str, char_to_byte: dict[str, int]) -> bytes:
    """What tokenizers' Rust ByteLevel decoder yields for one token: the mapped bytes if
    every char is in the byte alphabet, else the token's own UTF-8 (added tokens like
    '<|im end|>' with a plain space take that branch)."""
    try:
        return bytes([char_to_byte[c] for c in token])
    except KeyError:
        return token.encode("utf-8")
