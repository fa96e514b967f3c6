"""The ModelWorker gRPC servicer: maps RequestFrames to engine adds/aborts and coalesces
engine outputs into TokenFrames (every output waiting for a stream goes into one frame).

Thin shell: validation and generation live in the engine; this file only speaks the proto.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from model_worker.engine import SequenceOutput
from model_worker.engine_loop import EngineLoop, NewRequest, RequestFailure, StreamOutbox
from model_worker.sequence import SamplingParams
from tokenwire.packing import pack_float32, pack_int32
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

logger = logging.getLogger(__name__)

_STREAM_CLOSED = object()


def sampling_from_proto(add: pb.AddRequest) -> SamplingParams:
    s = add.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.top_p != 0.0 else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=add.logprobs,
        top_logprobs=add.top_logprobs if add.logprobs else 0,
    )


class _SequenceFrameBuilder:
    """Accumulates one request's outputs of several steps into one SequenceTokens."""

    __slots__ = ("request_id", "token_ids", "logprobs", "top_ids", "top_lps", "last")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: list[int] = []
        self.top_lps: list[float] = []
        self.last: SequenceOutput | None = None

    def add(self, out: SequenceOutput) -> None:
        if out.token_id is not None:
            self.token_ids.append(out.token_id)
            if out.logprob is not None:
                self.logprobs.append(out.logprob)
                self.top_ids.extend(out.top_token_ids)
                self.top_lps.extend(out.top_logprobs)
        self.last = out

    def build(self) -> pb.SequenceTokens:
        last = self.last
        n = len(self.token_ids)
        k = len(self.top_ids) // n if n and self.top_ids else 0
        return pb.SequenceTokens(
            request_id=self.request_id,
            token_ids=pack_int32(self.token_ids),
            logprobs=pack_float32(self.logprobs) if self.logprobs else b"",
            num_top_logprobs=k,
            top_token_ids=pack_int32(self.top_ids) if k else b"",
            top_logprobs=pack_float32(self.top_lps) if k else b"",
            finish_reason=int(last.finish_reason),
            stop_token_id=last.stop_token_id,
            num_prompt_tokens=last.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens,
        )


def build_frame(items: list) -> pb.TokenFrame:
    builders: dict[str, _SequenceFrameBuilder] = {}
    failures: list[pb.SequenceTokens] = []
    for item in items:
        if isinstance(item, RequestFailure):
            failures.append(pb.SequenceTokens(
                request_id=item.request_id, finish_reason=pb.FINISH_REASON_ERROR,
                error=pb.RequestError(code=item.code.value[0], message=item.message)))
            continue
        request_id, out = item
        builder = builders.get(request_id)
        if builder is None:
            builder = builders[request_id] = _SequenceFrameBuilder(request_id)
        builder.add(out)
    return pb.TokenFrame(sequences=[b.build() for b in builders.values()] + failures)


class ModelWorkerServicer(model_worker_pb2_grpc.ModelWorkerServicer):
    def __init__(self, loop: EngineLoop, model_info: pb.ModelInfo) -> None:
        self.loop = loop
        self.model_info = model_info

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.model_info

    async def Generate(self, request_iterator, context) -> AsyncIterator[pb.TokenFrame]:
        outbox = StreamOutbox()
        reader = asyncio.create_task(self._read_requests(request_iterator, outbox))
        input_closed = False
        try:
            while not (input_closed and not outbox.live and outbox.queue.empty()):
                items = [await outbox.queue.get()]
                # Coalesce everything already waiting: under load one frame carries several
                # steps of every request, so frames per second stay bounded.
                while not outbox.queue.empty():
                    items.append(outbox.queue.get_nowait())
                if any(i is _STREAM_CLOSED for i in items):
                    # The client is done sending; keep streaming until its requests end.
                    input_closed = True
                    items = [i for i in items if i is not _STREAM_CLOSED]
                if items:
                    yield build_frame(items)
        finally:
            # Cancelled or finished: anything still live would otherwise run for nobody.
            self.loop.abort_all(outbox)
            reader.cancel()

    async def _read_requests(self, request_iterator, outbox: StreamOutbox) -> None:
        try:
            async for frame in request_iterator:
                for add in frame.adds:
                    if not add.request_id:
                        outbox.queue.put_nowait(RequestFailure(
                            add.request_id, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"))
                    elif add.request_id in outbox.live:
                        outbox.queue.put_nowait(RequestFailure(
                            add.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                            f"request_id {add.request_id!r} is already live on this stream"))
                    else:
                        self.loop.add(outbox, NewRequest(
                            request_id=add.request_id,
                            prompt_token_ids=list(add.prompt_token_ids),
                            sampling=sampling_from_proto(add),
                            max_tokens=add.max_tokens,
                            stop_token_ids=list(add.stop_token_ids),
                            ignore_eos=add.ignore_eos,
                        ))
                for abort in frame.aborts:
                    self.loop.abort(outbox, abort.request_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # the client went away mid-read; Generate's finally aborts
            logger.debug("request stream ended with an error", exc_info=True)
        outbox.queue.put_nowait(_STREAM_CLOSED)

