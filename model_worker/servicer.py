"""The ModelWorker gRPC servicer: maps RequestFrames to engine adds/aborts and coalesces
engine outputs into TokenFrames (every output waiting for a stream goes into one frame).

Thin shell: validation and generation live in the engine; this file only speaks the proto.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from model_worker.engine import GrammarWait, SequenceOutput
from model_worker.engine_loop import EngineLoop, NewRequest, RequestFailure, StreamOutbox
from model_worker.sampling.prompt_logprobs import PromptLogprobs
from model_worker.sequence import FinishReason, LogprobsMode, SamplerOrder, SamplingParams
from model_worker.structured_output import constraint_from_proto
from tokenwire.packing import pack_float32, pack_int32
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

logger = logging.getLogger(__name__)

_STREAM_CLOSED = object()


@dataclass(frozen=True)
class _StreamFailed:
    """Queued by fail_streams: the Generate call ends with this status after what came before it."""

    code: grpc.StatusCode
    message: str


def _off_as(value: float, off: float) -> float:
    """The proto's "0 disables it" -> the parameter's neutral value."""
    return off if value == 0.0 else value


def grammar_wait_from_proto(structured_output: pb.StructuredOutput) -> GrammarWait | None:
    """StructuredOutput.after_token_ids / opening_token_id -> when the constraint starts."""
    if not structured_output.after_token_ids:
        return None
    opener = structured_output.opening_token_id if structured_output.HasField("opening_token_id") else None
    return GrammarWait(tuple(structured_output.after_token_ids), opener)


# vLLM's _MAX_TEMP: a positive temperature below it samples at it (vLLM raises it, with a warning),
# where the logits over a tinier one overflow float32.
MIN_TEMPERATURE = 1e-2


def sampling_from_proto(add: pb.AddRequest) -> SamplingParams:
    """AddRequest -> effective SamplingParams: unset fields take the defaults the proto documents."""
    s = add.sampling
    defaults = SamplingParams()
    temperature = s.temperature
    if 0 < temperature < MIN_TEMPERATURE and s.sampler_order != SamplerOrder.LLAMA_CPP:
        temperature = MIN_TEMPERATURE  # vLLM's rule: no positive temperature is greedy
    return SamplingParams(
        temperature=temperature,
        top_k=s.top_k,
        top_p=_off_as(s.top_p, 1.0),
        min_p=s.min_p,
        typical_p=_off_as(s.typical_p, 1.0),
        top_n_sigma=s.top_n_sigma,
        xtc_threshold=s.xtc_threshold,
        xtc_probability=s.xtc_probability,
        dry_multiplier=s.dry_multiplier,
        dry_base=s.dry_base if s.HasField("dry_base") else defaults.dry_base,
        dry_allowed_length=s.dry_allowed_length if s.HasField("dry_allowed_length") else defaults.dry_allowed_length,
        dry_penalty_last_n=s.dry_penalty_last_n if s.HasField("dry_penalty_last_n") else defaults.dry_penalty_last_n,
        dry_sequence_breakers=tuple(tuple(b.token_ids) for b in s.dry_sequence_breakers),
        mirostat=s.mirostat,
        mirostat_tau=s.mirostat_tau if s.HasField("mirostat_tau") else defaults.mirostat_tau,
        mirostat_eta=s.mirostat_eta if s.HasField("mirostat_eta") else defaults.mirostat_eta,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=_off_as(s.repetition_penalty, 1.0),
        repeat_penalty=_off_as(s.repeat_penalty, 1.0),
        penalty_last_n=s.penalty_last_n if s.HasField("penalty_last_n") else defaults.penalty_last_n,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
        bad_words=tuple(tuple(w.token_ids) for w in s.bad_words),
        allowed_token_ids=tuple(s.allowed_token_ids),
        sampler_order=SamplerOrder(s.sampler_order) if s.sampler_order in tuple(SamplerOrder) else s.sampler_order,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=add.logprobs,
        top_logprobs=add.top_logprobs,
        logprobs_mode=(LogprobsMode(add.logprobs_mode) if add.logprobs_mode in tuple(LogprobsMode)
                       else add.logprobs_mode),
        prompt_logprobs=add.prompt_logprobs if add.HasField("prompt_logprobs") else None,
    )


class _SequenceFrameBuilder:
    """Accumulates one request's outputs of several steps into one SequenceTokens."""

    __slots__ = ("request_id", "index", "token_ids", "logprobs", "top_ids", "top_lps", "cumulative", "prompt",
                 "last")

    def __init__(self, request_id: str, index: int) -> None:
        self.request_id = request_id
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: list[int] = []
        self.top_lps: list[float] = []
        self.cumulative: float | None = None
        self.prompt: PromptLogprobs | None = None
        self.last: SequenceOutput | None = None

    def add(self, out: SequenceOutput) -> None:
        if out.token_id is not None:
            self.token_ids.append(out.token_id)
            if out.logprob is not None:
                self.logprobs.append(out.logprob)
                self.top_ids.extend(out.top_token_ids)
                self.top_lps.extend(out.top_logprobs)
        if out.cumulative_logprob is not None:  # an ABORT output carries the sum so far, with no token
            self.cumulative = out.cumulative_logprob
        if out.prompt_logprobs is not None:
            self.prompt = out.prompt_logprobs
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
            error=(pb.RequestError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=last.error,
                                   field=last.error_field) if last.error else None),
            stop_token_id=last.stop_token_id,
            num_prompt_tokens=last.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens,
            index=self.index,
            num_cached_prompt_tokens=last.num_cached_prompt_tokens,
            cumulative_logprob=self.cumulative if self.cumulative is not None else 0.0,
            **self._prompt_fields(),
        )

    def _prompt_fields(self) -> dict:
        prompt = self.prompt
        if prompt is None:
            return {}
        return {
            "prompt_logprobs": pack_float32(prompt.logprobs),
            "prompt_ranks": pack_int32(prompt.ranks),
            "num_prompt_top_logprobs": prompt.num_top,
            "prompt_top_token_ids": pack_int32(prompt.top_token_ids) if prompt.num_top else b"",
            "prompt_top_logprobs": pack_float32(prompt.top_logprobs) if prompt.num_top else b"",
        }


def build_frame(items: list) -> pb.TokenFrame:
    """One frame of the items, in their order, each output's tokens merged into one entry per
    (request id, index). An entry that ends (a finish, a failure) closes its key: a request id
    reused on the stream (allowed once the old request has ended) may follow in the same frame,
    and its items must come after that end, in entries of their own, or the client would read the
    old request's end as the new one's."""
    open_builders: dict[tuple[str, int], _SequenceFrameBuilder] = {}
    entries: list[_SequenceFrameBuilder | pb.SequenceTokens] = []
    for item in items:
        if isinstance(item, RequestFailure):
            for key in [key for key in open_builders if key[0] == item.request_id]:
                del open_builders[key]
            entries.append(pb.SequenceTokens(
                request_id=item.request_id, finish_reason=pb.FINISH_REASON_ERROR,
                error=pb.RequestError(code=item.code.value[0], message=item.message, field=item.field)))
            continue
        request_id, out = item
        key = (request_id, out.index)
        builder = open_builders.get(key)
        if builder is None:
            builder = open_builders[key] = _SequenceFrameBuilder(request_id, out.index)
            entries.append(builder)
        builder.add(out)
        if out.finish_reason != FinishReason.NONE:
            del open_builders[key]
    return pb.TokenFrame(sequences=[e.build() if isinstance(e, _SequenceFrameBuilder) else e for e in entries])


# Outputs one TokenFrame coalesces at most: ~170 bytes each with 20 top logprobs, so a full frame
# stays far below gRPC's 64 MiB message limit (tokenwire.grpc_io), whatever the backlog.
MAX_ITEMS_PER_FRAME = 8192
# Outputs of a stream waiting to be sent past which its new adds are refused (RESOURCE_EXHAUSTED,
# as a full waiting room's) until they are down to half: a client that stops reading (gRPC's flow
# control then holds Generate's writes) while it keeps adding requests grew the worker by 8.5
# MiB/s, without bound (20 top logprobs a token, review 88). Its running requests still finish
# into the queue, and its aborts and its end are read as ever: a stream that stopped reading
# frames instead hung for good a client that writes before it reads (review 89). A gateway's
# stream sees a few hundred.
MAX_UNSENT_OUTPUTS = 65536


def new_request_from_proto(add: pb.AddRequest) -> NewRequest:
    return NewRequest(
        request_id=add.request_id,
        prompt_token_ids=list(add.prompt_token_ids),
        sampling=sampling_from_proto(add),
        max_tokens=add.max_tokens,
        stop_token_ids=list(add.stop_token_ids),
        ignore_eos=add.ignore_eos,
        n=add.n or 1,
        best_of=add.best_of,
        use_beam_search=add.use_beam_search,
        length_penalty=add.length_penalty if add.HasField("length_penalty") else 1.0,
        diversity_penalty=add.diversity_penalty,
        constraint=constraint_from_proto(add.structured_output),
        grammar_wait=grammar_wait_from_proto(add.structured_output),
        stream_interval=add.stream_interval,
        cache_salt=add.cache_salt,
    )


class ModelWorkerServicer(model_worker_pb2_grpc.ModelWorkerServicer):
    def __init__(self, loop: EngineLoop, model_info: pb.ModelInfo) -> None:
        self.loop = loop
        self.model_info = model_info
        self._streams: set[StreamOutbox] = set()  # of the open Generate calls

    def begin_drain(self) -> None:
        """At a drain's end: each Generate call ends (status OK) once its requests have, as when
        its client closes its side, so that its last frames go out before the server cancels calls."""
        for outbox in self._streams:
            outbox.queue.put_nowait(_STREAM_CLOSED)

    def fail_streams(self, code: grpc.StatusCode, message: str) -> None:
        """Ends every open Generate call with this status (after the frames already queued), its
        requests with it: for a worker that can serve none of them any more (a hung step), so that
        the gateway fails them at once with the reason, not when its clients give up."""
        for outbox in self._streams:
            outbox.queue.put_nowait(_StreamFailed(code, message))

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def is_drained(self) -> bool:
        """Nothing left to send: no request of any open stream is live, and no output of one
        waits in its queue or is being framed. The engine having no work is not enough: its last
        outputs still cross to the event loop and into a frame after the step that ended them."""
        return not self.loop.engine.has_work() and all(
            not outbox.live and not outbox.unanswered and outbox.queue.empty() and not outbox.framing
            for outbox in self._streams)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.model_info

    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.WorkerLoad:
        # Plain counters read between or during a step: a snapshot, never a torn structure.
        engine = self.loop.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        return pb.WorkerLoad(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            max_waiting=engine.max_waiting_requests,
            max_num_seqs=scheduler.max_num_seqs,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_used=blocks.num_used_blocks,
            kv_block_size=blocks.block_size,
            prefix_cache_queried_tokens=blocks.prefix_queried_tokens,
            prefix_cache_hit_tokens=blocks.prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
        )

    async def Generate(self, request_iterator, context) -> AsyncIterator[pb.TokenFrame]:
        outbox = StreamOutbox()
        self._streams.add(outbox)
        reader = asyncio.create_task(self._read_requests(request_iterator, outbox))
        input_closed = False
        try:
            while not (input_closed and not outbox.live and not outbox.unanswered and outbox.queue.empty()):
                items = [await outbox.queue.get()]
                outbox.framing = True
                # Coalesce everything already waiting: under load one frame carries several
                # steps of every request, so frames per second stay bounded. Up to a bound: after a
                # client that stopped reading comes back, one frame of its whole backlog could pass
                # gRPC's message limit and end the stream.
                while not outbox.queue.empty() and len(items) < MAX_ITEMS_PER_FRAME:
                    items.append(outbox.queue.get_nowait())
                if any(i is _STREAM_CLOSED for i in items):
                    # The client is done sending; keep streaming until its requests end.
                    input_closed = True
                    items = [i for i in items if i is not _STREAM_CLOSED]
                failed = next((i for i in items if isinstance(i, _StreamFailed)), None)
                if failed is not None:
                    items = [i for i in items if not isinstance(i, _StreamFailed)]
                if items:
                    yield build_frame(items)  # resumes once gRPC has taken the frame
                outbox.framing = False
                if outbox.backlogged and outbox.queue.qsize() <= MAX_UNSENT_OUTPUTS // 2:
                    outbox.backlogged = False
                if failed is not None:
                    await context.abort(failed.code, failed.message)
        finally:
            self._streams.discard(outbox)
            # Cancelled or finished: anything still live would otherwise run for nobody.
            self.loop.abort_all(outbox)
            reader.cancel()

    async def _read_requests(self, request_iterator, outbox: StreamOutbox) -> None:
        try:
            async for frame in request_iterator:
                for add in frame.adds:
                    if not add.request_id:
                        outbox.queue.put_nowait(RequestFailure(
                            add.request_id, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty", "request_id"))
                    elif add.request_id in outbox.live:
                        # Frames name requests by id alone, so a refusal under the id would read as
                        # the live request's end while its tokens still came: it ends too, and this
                        # error is the one last frame of the id.
                        self.loop.abort(outbox, add.request_id, RequestFailure(
                            add.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                            f"request_id {add.request_id!r} was added again while live on this stream; "
                            "that request is ended too", "request_id"))
                    elif outbox.backlogged or outbox.queue.qsize() > MAX_UNSENT_OUTPUTS:
                        outbox.backlogged = True
                        outbox.queue.put_nowait(RequestFailure(
                            add.request_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"more than {MAX_UNSENT_OUTPUTS} outputs of this stream wait for its client to read "
                            "them: no new request is taken on it until half have gone"))
                    else:
                        try:
                            request = new_request_from_proto(add)
                        except Exception:  # a bug, not bad input (that is the engine's to refuse)
                            logger.exception("reading request %s failed", add.request_id)
                            outbox.queue.put_nowait(RequestFailure(
                                add.request_id, grpc.StatusCode.INTERNAL,
                                "reading the request failed; see the model worker's log"))
                            continue
                        self.loop.add(outbox, request)
                for abort in frame.aborts:
                    if abort.indexes:
                        self.loop.abort_outputs(outbox, abort.request_id, set(abort.indexes))
                    else:
                        self.loop.abort(outbox, abort.request_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # the client went away mid-read; Generate's finally aborts
            logger.debug("request stream ended with an error", exc_info=True)
        outbox.queue.put_nowait(_STREAM_CLOSED)

