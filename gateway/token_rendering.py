"""How logprob tokens read (OpenAI's `token` and `bytes`): rendered by the detok worker, cached.

The pipeline owns one renderer and picks it in one place (Pipeline.renderer). DetokRenderer
learns ids from the TextDelta.rendered replies to the render_token_ids the pipeline sends with
each new token (and its alternatives), and asks RenderTokens for any other id (echoed prompts,
prompt logprobs). LocalRenderer renders with the gateway's own tokenizer, with the same
convention ("bytes:\\xNN" for a piece of a character).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from gateway.prompt_tokenizer import PromptTokenizer
from tokenwire.packing import unpack_int32
from tokenwire.v1 import detok_worker_pb2


class TokenRenderer(Protocol):
    # Whether the pipeline should ask the detok worker to render each new token as it streams.
    renders_in_stream: bool

    async def ensure(self, token_ids: Iterable[int]) -> None:
        """Makes token_text / token_bytes answer for these ids."""
        ...

    def absorb(self, token_ids: Sequence[int], rendered: detok_worker_pb2.RenderedTokens) -> None:
        """Learns from a TextDelta.rendered that answered render_token_ids."""
        ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class LocalRenderer:
    renders_in_stream = False

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self._tokenizer = tokenizer

    async def ensure(self, token_ids: Iterable[int]) -> None:
        return None

    def absorb(self, token_ids: Sequence[int], rendered: detok_worker_pb2.RenderedTokens) -> None:
        return None

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.token_text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tokenizer.token_bytes(token_id)


RenderTokensCall = Callable[[Sequence[int]], Awaitable[detok_worker_pb2.RenderedTokens]]


class DetokRenderer:
    """id -> (text, bytes), as the detok worker renders them; at most one entry per vocab id."""

    renders_in_stream = True

    def __init__(self, render_tokens: RenderTokensCall) -> None:
        self._render_tokens = render_tokens
        self._rendered: dict[int, tuple[str, bytes]] = {}

    def absorb(self, token_ids: Sequence[int], rendered: detok_worker_pb2.RenderedTokens) -> None:
        """Learns the rendering of token_ids (in order) from a RenderedTokens reply."""
        offsets = unpack_int32(rendered.offsets).tolist() if rendered.offsets else []
        for i, (token_id, text) in enumerate(zip(token_ids, rendered.text, strict=False)):
            if token_id not in self._rendered and i + 1 < len(offsets):
                self._rendered[token_id] = (text, rendered.data[offsets[i]:offsets[i + 1]])

    async def ensure(self, token_ids: Iterable[int]) -> None:
        missing = sorted({t for t in token_ids if t not in self._rendered})
        if missing:
            self.absorb(missing, await self._render_tokens(missing))

    def token_text(self, token_id: int) -> str:
        return self._rendered[token_id][0]

    def token_bytes(self, token_id: int) -> bytes:
        return self._rendered[token_id][1]


class TokenIdLabels:
    """vLLM's return_tokens_as_token_ids: logprob tokens shown as "token_id:N" (a client that
    re-tokenizes nothing, as RL trainers want), their bytes still the token's own."""

    def __init__(self, renderer: TokenRenderer) -> None:
        self._renderer = renderer
        self.renders_in_stream = renderer.renders_in_stream

    async def ensure(self, token_ids: Iterable[int]) -> None:
        await self._renderer.ensure(token_ids)

    def absorb(self, token_ids: Sequence[int], rendered: detok_worker_pb2.RenderedTokens) -> None:
        self._renderer.absorb(token_ids, rendered)

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return self._renderer.token_bytes(token_id)
