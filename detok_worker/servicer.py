"""The Detokenizer gRPC servicer: a thin asyncio shell around one DetokenizeStream per call,
and around the token renderer for RenderTokens.

__main__.py registers it on the server; every frame the gateway sends is answered by
exactly one TextDeltaFrame, in order.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from detok_worker.render import renderer_for
from detok_worker.stream import BadFrameError, DetokenizeStream, OpenDecoding
from detok_worker.token_table import decoding_with_tables
from tokenwire.packing import unpack_int32
from tokenwire.v1 import detok_worker_pb2, detok_worker_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_FULL_NAME = detok_worker_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name


class DetokenizerServicer(detok_worker_pb2_grpc.DetokenizerServicer):
    def __init__(self, open_decoding: OpenDecoding = decoding_with_tables) -> None:
        self._open_decoding = open_decoding
        self._streams: set[DetokenizeStream] = set()

    def is_drained(self) -> bool:
        """No open sequence on any stream: a draining worker may stop (the gateway's streams
        stay open for good, so their end cannot say it)."""
        return not any(stream.live_sequence_ids for stream in self._streams)

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[detok_worker_pb2.DetokenizeFrame],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[detok_worker_pb2.TextDeltaFrame]:
        stream = DetokenizeStream(self._open_decoding)
        num_frames = 0
        self._streams.add(stream)
        try:
            async for frame in request_iterator:
                try:
                    reply = stream.apply(frame)
                except BadFrameError as exc:
                    logger.warning("aborting Detokenize stream after %d frames: %s", num_frames, exc)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    return  # abort raises; this only makes the end of the stream explicit
                num_frames += 1
                yield reply
        finally:
            self._streams.discard(stream)
        logger.debug("Detokenize stream ended after %d frames, %d sequences still open",
                     num_frames, len(stream.live_sequence_ids))

    async def RenderTokens(
        self,
        request: detok_worker_pb2.RenderTokensRequest,
        context: grpc.aio.ServicerContext,
    ) -> detok_worker_pb2.RenderedTokens:
        try:
            decoding = self._open_decoding(request.tokenizer)
        except Exception as exc:  # a missing or mismatched tokenizer is the caller's to fix
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"cannot load tokenizer {request.tokenizer.path!r}: {exc}")
        try:
            return renderer_for(decoding).render(unpack_int32(request.token_ids))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
