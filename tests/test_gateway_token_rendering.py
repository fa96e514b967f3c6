"""Unit tests of logprob token rendering: the detok renderer's cache and the ids the pipeline asks for.

The RenderTokens call is a plain coroutine here, answering as the detok worker's RenderedTokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.pipeline import logprob_ids
from gateway.token_rendering import DetokRenderer
from tokenwire.packing import pack_int32
from tokenwire.v1 import detok_worker_pb2, model_worker_pb2


def rendered(pieces: Sequence[bytes]) -> detok_worker_pb2.RenderedTokens:
    offsets = [0]
    for piece in pieces:
        offsets.append(offsets[-1] + len(piece))
    texts = [p.decode() if p.isascii() else "bytes:" + "".join(f"\\x{b:02x}" for b in p) for p in pieces]
    return detok_worker_pb2.RenderedTokens(text=texts, data=b"".join(pieces), offsets=pack_int32(offsets))


async def test_detok_renderer_asks_only_for_ids_it_has_not_seen() -> None:
    asked: list[list[int]] = []

    async def render_tokens(ids: Sequence[int]) -> detok_worker_pb2.RenderedTokens:
        asked.append(list(ids))
        return rendered([b"t%d" % i for i in ids])

    renderer = DetokRenderer(render_tokens)
    renderer.absorb([7, 8], rendered([b" a", b"\xe2\x80"]))  # from a TextDelta.rendered
    assert renderer.token_text(7) == " a" and renderer.token_bytes(8) == b"\xe2\x80"
    assert renderer.token_text(8) == "bytes:\\xe2\\x80"
    await renderer.ensure([7, 9, 8, 10, 9])
    assert asked == [[9, 10]]
    assert renderer.token_text(10) == "t10" and renderer.token_bytes(9) == b"t9"
    await renderer.ensure([9, 10])
    assert asked == [[9, 10]]


def test_logprob_ids_are_each_token_then_its_alternatives() -> None:
    seq = model_worker_pb2.SequenceTokens(token_ids=pack_int32([5, 6]), num_top_logprobs=2,
                                          top_token_ids=pack_int32([5, 1, 6, 2]))
    assert logprob_ids(seq) == [5, 5, 1, 6, 6, 2]
    assert logprob_ids(model_worker_pb2.SequenceTokens(token_ids=pack_int32([3]))) == [3]
