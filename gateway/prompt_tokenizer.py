"""The gateway's tokenizer: chat template and prompt text in, token ids out; token strings for logprobs.

Loaded once at startup from the model worker's TokenizerIdentity (hash-checked); app.py
encodes each prompt with it before the pipeline sends the ids to the model worker.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from gateway.errors import invalid_request
from tokenwire.tokenizer_files import TOKENIZER_JSON, TokenizerMismatchError, file_sha256
from tokenwire.v1 import common_pb2


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE spells every byte as one printable char."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(backend_json: str) -> bool:
    decoder = json.loads(backend_json).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


class PromptTokenizer:
    """A transformers tokenizer plus the chat template the model worker publishes."""

    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None) -> None:
        self._hf = hf_tokenizer
        self._chat_template = chat_template or None
        self._byte_level = _is_byte_level(hf_tokenizer.backend_tokenizer.to_str())
        self._token_bytes_cache: dict[int, bytes] = {}

    @classmethod
    def load(cls, identity: common_pb2.TokenizerIdentity, chat_template: str = "") -> PromptTokenizer:
        """Loads the tokenizer the model worker names, refusing one whose tokenizer.json differs."""
        from transformers import AutoTokenizer  # slow import: only at startup

        tokenizer_json = Path(identity.path) / TOKENIZER_JSON
        actual = file_sha256(tokenizer_json)
        if identity.sha256 and actual != identity.sha256:
            raise TokenizerMismatchError(
                f"{tokenizer_json} has sha256 {actual[:12]}…, the model worker serves {identity.sha256[:12]}…")
        return cls(AutoTokenizer.from_pretrained(identity.path), chat_template)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self._chat_template is None and getattr(self._hf, "chat_template", None) is None:
            raise invalid_request("this model has no chat template; use /v1/completions", param="messages")
        try:
            ids = self._hf.apply_chat_template(messages, chat_template=self._chat_template,
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # jinja raises on conversations its template rejects
            raise invalid_request(f"chat template failed on these messages: {exc}", param="messages") from exc
        return list(ids)

    def encode_text(self, text: str) -> list[int]:
        # The tokenizer's own defaults (SmolLM2 adds no BOS), so ids match transformers' generate.
        return list(self._hf(text)["input_ids"])

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a piece of a UTF-8 character, possibly)."""
        cached = self._token_bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._hf.convert_ids_to_tokens(token_id)
        byte_of_char = _byte_of_char()
        if self._byte_level and piece is not None and all(ch in byte_of_char for ch in piece):
            raw = bytes(byte_of_char[ch] for ch in piece)
        else:
            raw = self._hf.decode([token_id]).encode()
        self._token_bytes_cache[token_id] = raw
        return raw

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")
