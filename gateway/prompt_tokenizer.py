"""The gateway's tokenizer: chat template and prompt text in, token ids out; token strings for logprobs.

Loaded once at startup from the model worker's TokenizerIdentity (hash-checked); app.py
encodes each prompt with it before the pipeline sends the ids to the model worker.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

from gateway.errors import invalid_request
from tokenwire.byte_level import is_byte_level, token_piece_bytes, unicode_to_bytes
from tokenwire.tokenizer_files import id_span, verified_tokenizer_json
from tokenwire.v1 import common_pb2

# Prompts longer than this many characters are tokenized on a worker thread: the tokenizer releases
# the GIL, so the event loop keeps streaming other requests meanwhile (a 3.6 MB prompt took 1.2-2.2 s
# to encode, and every stream stalled that long). Shorter ones stay inline, where a thread hop
# (~0.1 ms) would be most of their cost; 4096 characters encode in ~1.5 ms.
INLINE_ENCODE_MAX_CHARS = 4096
# What a message costs the template beyond its text: its turn's markup, written whatever the
# content (450,000 messages without content, counted as 0 chars, were templated on the event loop:
# 8.6 s, every stream stopped; review 97).
MESSAGE_MARKUP_CHARS = 32
T = TypeVar("T")
# Distinct chat_template_kwargs whose generation prompt is kept (a client could send endless ones).
_MAX_CACHED_GENERATION_PROMPTS = 64


class PromptTokenizer:
    """A transformers tokenizer plus the chat template the model worker publishes."""

    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None) -> None:
        self._hf = hf_tokenizer
        own = getattr(hf_tokenizer, "chat_template", None)
        if chat_template and chat_template == (own.get("default") if isinstance(own, dict) else own):
            # The tokenizer's own: transformers then picks the named template a request needs, as
            # vLLM does (tool_use when it sends tools; a dir saved with additional_chat_templates/).
            # Passed by name, the default was rendered for tools too, and the model never saw them.
            chat_template = None
        self._chat_template = chat_template or None
        self._byte_level = is_byte_level(hf_tokenizer.backend_tokenizer)
        # One past its largest id: a prompt's ids beyond it (a padded embedding's rows) no
        # tokenizer can spell, and vLLM refuses them as out of vocabulary.
        self.id_span = id_span(hf_tokenizer.backend_tokenizer)
        self._token_bytes_cache: dict[int, bytes] = {}
        self._generation_prompts: dict[str, str] = {}  # generation_prompt's, by template kwargs

    @classmethod
    def load(cls, identity: common_pb2.TokenizerIdentity, chat_template: str = "") -> PromptTokenizer:
        """Loads the tokenizer the model worker names, refusing one whose tokenizer.json differs."""
        from transformers import AutoTokenizer  # slow import: only at startup

        verified_tokenizer_json(identity)
        return cls(AutoTokenizer.from_pretrained(identity.path), chat_template)

    def encode_chat(self, messages: list[dict[str, object]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    documents: list[dict[str, Any]] | None = None) -> list[int]:
        """template_kwargs: extra variables for the template (chat_template_kwargs); tools: the
        request's function definitions, for templates that describe them; documents: retrieved
        documents, for templates of retrieval-augmented models."""
        if self._chat_template is None and getattr(self._hf, "chat_template", None) is None:
            raise invalid_request("this model has no chat template; use /v1/completions", param="messages")
        try:
            ids = self._hf.apply_chat_template(messages, chat_template=self._chat_template,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, tools=tools,
                                               documents=documents,
                                               tokenize=True, return_dict=False, **(template_kwargs or {}))
        except Exception as exc:  # jinja raises on conversations its template rejects
            raise invalid_request(f"chat template failed on these messages: {exc}", param="messages") from exc
        return list(ids)

    def generation_prompt(self, template_kwargs: dict[str, Any] | None = None) -> str:
        """What the template appends to open the assistant's turn (add_generation_prompt), e.g.
        Qwen3's "<think>\n\n</think>\n\n" with enable_thinking false: the template rendered for
        a one-message conversation with and without it. "" where that is not a plain suffix or
        the template fails on it. Cached per template kwargs (a few distinct ones in practice)."""
        key = json.dumps(template_kwargs or {}, sort_keys=True, default=str)
        cached = self._generation_prompts.get(key)
        if cached is None:
            if len(self._generation_prompts) >= _MAX_CACHED_GENERATION_PROMPTS:
                self._generation_prompts.clear()
            cached = self._generation_prompts[key] = self._render_generation_prompt(template_kwargs or {})
        return cached

    def _render_generation_prompt(self, template_kwargs: dict[str, Any]) -> str:
        conversation = [{"role": "user", "content": "x"}]
        try:
            bare = self._hf.apply_chat_template(conversation, chat_template=self._chat_template,
                                                add_generation_prompt=False, tokenize=False, **template_kwargs)
            opened = self._hf.apply_chat_template(conversation, chat_template=self._chat_template,
                                                  add_generation_prompt=True, tokenize=False, **template_kwargs)
        except Exception:  # a template that wants more than one user message: no tail known
            return ""
        return opened[len(bare):] if isinstance(bare, str) and opened.startswith(bare) else ""

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The tokenizer's own defaults (SmolLM2 adds no BOS), so ids match transformers' generate.
        return list(self._hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def encode_chat_async(self, messages: list[dict[str, object]], add_generation_prompt: bool = True,
                                continue_final_message: bool = False,
                                template_kwargs: dict[str, Any] | None = None,
                                tools: list[dict[str, Any]] | None = None,
                                documents: list[dict[str, Any]] | None = None) -> list[int]:
        """encode_chat, off the event loop for a long conversation (INLINE_ENCODE_MAX_CHARS)."""
        chars = sum(map(_message_chars, messages))
        chars += sum(len(v) for d in documents or () for v in d.values() if isinstance(v, str))
        # Templates that describe tools render their schemas into the prompt (Qwen2.5, Hermes).
        chars += sum(len(json.dumps(t, default=str)) for t in tools or ())
        return await off_loop_if_large(chars, INLINE_ENCODE_MAX_CHARS, self.encode_chat, messages,
                                       add_generation_prompt, continue_final_message, template_kwargs, tools,
                                       documents)

    def encode_texts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """A batch of texts in one call: the tokenizer encodes them together, in parallel, with the
        GIL released (per text, each call's Python overhead costs more than a short prompt's encode)."""
        if not texts:
            return []
        return [list(ids) for ids in self._hf(texts, add_special_tokens=add_special_tokens)["input_ids"]]

    async def encode_text_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode_text, off the event loop for a long text (INLINE_ENCODE_MAX_CHARS)."""
        return await off_loop_if_large(len(text), INLINE_ENCODE_MAX_CHARS, self.encode_text, text, add_special_tokens)

    def encode_words(self, text: str) -> list[int]:
        """Text as it would read inside an output: no BOS or other special tokens (bad_words)."""
        return self.encode_text(text, add_special_tokens=False)

    @functools.cached_property
    def _special_texts(self) -> frozenset[str]:
        added = getattr(self._hf, "added_tokens_decoder", {}) or {}
        return frozenset(t.content for t in added.values() if getattr(t, "special", False)) | frozenset(
            self._hf.all_special_tokens)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The added tokens marked special: those the detok worker leaves out of the text under
        skip_special_tokens (detok_worker/token_bytes.py reads the same flag)."""
        added = getattr(self._hf, "added_tokens_decoder", {}) or {}
        return frozenset(i for i, t in added.items() if getattr(t, "special", False))

    def special_texts(self) -> frozenset[str]:
        """The texts of the vocabulary's special tokens (those skip_special_tokens leaves out)."""
        return self._special_texts

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a piece of a UTF-8 character, possibly)."""
        cached = self._token_bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._hf.convert_ids_to_tokens(token_id)
        if self._byte_level and piece is not None:
            raw = token_piece_bytes(piece, unicode_to_bytes())
        else:
            raw = self._hf.decode([token_id]).encode()
        self._token_bytes_cache[token_id] = raw
        return raw

    def vocabulary_tokens(self, token_ids: list[int]) -> list[str]:
        """The ids' tokens as the vocabulary spells them ("Ġworld" in a byte-level one):
        /tokenize's token_strs, vLLM's convert_ids_to_tokens, which a client can map back to ids."""
        return self._hf.convert_ids_to_tokens(token_ids)

    def token_text(self, token_id: int) -> str:
        """The token as logprobs show it: its text, or for a token that is only part of a UTF-8
        character, "bytes:" + \\xNN escapes (vLLM's convention; the detok worker's RenderTokens
        answers the same), so no token shows U+FFFD."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


async def off_loop_if_large(size: int, inline_max: int, work: Callable[..., T], *args: Any) -> T:
    """work(*args) inline for a size of at most inline_max, on a worker thread beyond: inline, a
    small job skips the thread hop (~0.1 ms); a large one would hold the event loop, and every
    other request's stream with it."""
    if size <= inline_max:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def _message_chars(message: dict[str, object]) -> int:
    """A message's size for INLINE_ENCODE_MAX_CHARS: its markup, its strings, and the JSON of the rest
    (tool_calls), which templates render too."""
    chars = MESSAGE_MARKUP_CHARS
    for value in message.values():
        if isinstance(value, str):
            chars += len(value)
        elif value is not None:
            chars += len(json.dumps(value, default=str))
    return chars
