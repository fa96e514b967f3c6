"""Per-request orchestration: prompt ids → model worker → detok worker → GenerationEvents.

app.py calls Pipeline.generate once per prompt (all n choices in one request), placed on one
model worker replica (ModelWorkerPool.pick); each replica's reader forwards every TokenFrame in
bulk (one DetokenizeFrame per detok replica) and the detok readers push the text deltas into the
per-request queues that generate() drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from gateway.config import Config
from gateway.detok_client import ColumnRow, DetokClient
from gateway.detok_pool import DetokPool
from gateway.errors import RETRY_AFTER_S, APIError, from_grpc_code, workers_unavailable
from gateway.frame_stream import wait_any_connected, why_lost
from gateway.metrics import GatewayMetrics
from gateway.model_worker_client import ModelWorkerClient
from gateway.model_worker_pool import ModelWorkerPool
from gateway.prompt_tokenizer import PromptTokenizer
from gateway.request_mapping import GenerationParams, add_request, open_sequence
from gateway.request_state import GenerationEvent, RequestState, prompt_logprobs_of
from gateway.token_rendering import DetokRenderer, TokenRenderer
from tokenwire.packing import pack_int32, unpack_int32
from tokenwire.v1 import detok_worker_pb2, model_worker_pb2

logger = logging.getLogger(__name__)

_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]  # a full waiting queue
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


@dataclass
class _LiveRequest:
    request_id: str
    # One per output index (n of them); state.request_id is the output's detok sequence id.
    states: list[RequestState]
    params: GenerationParams
    prompt_token_ids: Sequence[int]
    detok: DetokClient
    # The model worker replica running it: its adds, aborts and TokenFrames go through this one.
    model: ModelWorkerClient
    events: asyncio.Queue[tuple[int, GenerationEvent] | APIError]
    # Every output has its finish_reason from the model worker (or the worker dropped it).
    model_finished: bool = False
    # Replicas that refused it as full before it ran anywhere.
    models_full: list[ModelWorkerClient] = field(default_factory=list)
    # Some SequenceTokens of it came from a model worker (until then a lost replica loses nothing of it).
    model_replied: bool = False


class Pipeline:
    """Owns the worker streams and the table of live requests both readers dispatch into."""

    def __init__(self, config: Config, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.model_workers = ModelWorkerPool(config, self._on_replica_token_frame, self._on_model_lost)
        self.detok_pool = DetokPool(config, self._on_text_delta_frame, self._on_detok_lost)
        self._live: dict[str, _LiveRequest] = {}
        self._closing = ""  # once set (fail_open_requests), why every new request fails at once
        # detok sequence id -> (request, output index)
        self._sequences: dict[str, tuple[_LiveRequest, int]] = {}
        self.model_info = model_worker_pb2.ModelInfo()
        self.tokenizer: PromptTokenizer | None = None
        self.renderer: TokenRenderer | None = None

    @classmethod
    async def connect(cls, config: Config, metrics: GatewayMetrics | None = None) -> Pipeline:
        """Waits (up to config.startup_timeout_s) for both kinds of worker, then opens the streams."""
        pipeline = cls(config, metrics)
        try:
            await pipeline._start()
        except BaseException:
            await pipeline.close()
            raise
        return pipeline

    async def _start(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        # Every model worker replica must serve this one model; the pool refuses any other.
        await self.model_workers.start(self.config.startup_timeout_s)
        self.model_info = self.model_workers.model_info
        # All replicas at once: each first loads the tokenizer (its warm-up, DetokClient._warm),
        # meanwhile the gateway loads its own. Serving starts once one is up, as with model worker
        # replicas: the others (down, or slower to warm) keep connecting in the background and
        # /ready lists them meanwhile.
        await self.detok_pool.start(self.model_info.tokenizer, deadline, time.monotonic)
        self.tokenizer = await asyncio.to_thread(
            PromptTokenizer.load, self.model_info.tokenizer, self.model_info.chat_template)
        # Logprob tokens as the detok worker renders them; LocalRenderer(self.tokenizer) is the
        # in-gateway fallback with the same convention.
        self.renderer = DetokRenderer(self._render_tokens)
        if not await wait_any_connected([d.stream for d in self.detoks], max(deadline - time.monotonic(), 1.0)):
            raise TimeoutError(f"no detok worker stream within {self.config.startup_timeout_s:.0f}s: " + ", ".join(
                f"{d.address} ({d.refusal})" if d.refusal else d.address for d in self.detoks))

    def fail_open_requests(self, why: str) -> None:
        """Ends every live request with a 503 saying why (streams: an error event, then [DONE]),
        and every one submitted from now on (one still being tokenized now)."""
        self._closing = why
        for request in list(self._live.values()):
            self._fail(request, workers_unavailable(why))

    async def close(self) -> None:
        self.fail_open_requests("the gateway is shutting down")
        await asyncio.gather(self.model_workers.close(), self.detok_pool.close())

    @property
    def ready(self) -> bool:
        """At least one model worker replica and one detok replica take new requests."""
        return self.model_workers.any_connected and self.detok_pool.pick() is not None

    @property
    def prompt_vocab_size(self) -> int:
        """Prompt ids must be below it: the model's and the tokenizer's ids (vLLM's check)."""
        span = self.tokenizer.id_span if self.tokenizer is not None else 0
        return min(self.model_info.vocab_size, span) if span else self.model_info.vocab_size

    @property
    def detoks(self) -> list[DetokClient]:
        """Every detok replica (retired ones included, while sequences are open there)."""
        return self.detok_pool.replicas

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    async def generate(self, prompt_token_ids: Sequence[int],
                       params: GenerationParams) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """(output index, event) pairs of one prompt's n choices, in arrival order, until every
        choice has its finish_reason; raises APIError when the request fails.

        One AddRequest asks the model worker for all n outputs (they share the prompt's KV
        cache); SequenceTokens.index says which output each token run belongs to, and each
        output is its own detok sequence. Leaving early (client gone, task cancelled) aborts the
        request on the model worker and closes its detok sequences.
        """
        if self._closing:
            raise workers_unavailable(self._closing)
        model = self.model_workers.pick()
        if model is None:
            raise workers_unavailable("no model worker is connected")
        detok = self._pick_detok()
        request_id = uuid.uuid4().hex
        states = [RequestState(f"{request_id}-{i}", len(prompt_token_ids)) for i in range(params.n)]
        request = _LiveRequest(request_id, states, params, prompt_token_ids, detok, model, asyncio.Queue())
        self._live[request_id] = request
        for index, state in enumerate(states):
            self._sequences[state.request_id] = (request, index)
        detok.num_open_sequences += len(states)
        model.num_sequences += len(states)
        model.add(add_request(request_id, prompt_token_ids, params))
        try:
            num_finished = 0
            while num_finished < len(states):
                item = await request.events.get()
                if isinstance(item, APIError):
                    raise item
                yield item
                if item[1].finish_reason is not None:
                    num_finished += 1
        finally:
            if self._live.get(request_id) is request:
                self._end(request)
            request.detok.num_open_sequences -= len(states)  # it may have moved (_on_detok_lost)
            request.model.num_sequences -= len(states)

    async def _render_tokens(self, token_ids: Sequence[int]) -> detok_worker_pb2.RenderedTokens:
        request = detok_worker_pb2.RenderTokensRequest(tokenizer=self.model_info.tokenizer,
                                                       token_ids=pack_int32(token_ids))
        detok = self._pick_detok()
        try:
            return await detok.render_tokens(request)
        except grpc.aio.AioRpcError as exc:
            if self.metrics is not None:
                self.metrics.detok_rpc_errors.labels(worker=detok.address, rpc="RenderTokens").inc()
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise APIError(400, f"cannot render tokens: {exc.details()}") from exc
            raise workers_unavailable(f"detok worker RenderTokens failed: {exc.code().name}") from exc

    def _pick_detok(self) -> DetokClient:
        detok = self.detok_pool.pick()
        if detok is None:
            raise workers_unavailable("no detok worker is connected")
        return detok

    def _end(self, request: _LiveRequest) -> None:
        """Forgets a request and stops what is still running of it on both workers."""
        self._live.pop(request.request_id, None)
        for state in request.states:
            self._sequences.pop(state.request_id, None)
            if state.detok_opened and not state.finished:
                request.detok.close_sequence(state.request_id)
        if not request.model_finished:
            request.model.abort(request.request_id)

    def _fail(self, request: _LiveRequest, error: APIError) -> None:
        self._end(request)
        request.events.put_nowait(error)

    # ---- reader callbacks: run on the event loop, never await ----

    def _on_replica_token_frame(self, replica: ModelWorkerClient, frame: model_worker_pb2.TokenFrame) -> None:
        """Hands _on_token_frame only the sequences of requests placed on `replica`; a request it
        refused as full (before running it) moves to another replica instead of failing with 429."""
        keep = [self._keeps(replica, seq) for seq in frame.sequences]
        if not all(keep):
            frame = model_worker_pb2.TokenFrame(sequences=[s for s, k in zip(frame.sequences, keep, strict=True) if k])
        self._on_token_frame(frame)

    def _keeps(self, replica: ModelWorkerClient, seq: model_worker_pb2.SequenceTokens) -> bool:
        request = self._live.get(seq.request_id)
        if request is None:
            return True  # _on_token_frame drops it: ended here, the worker has not heard yet
        if request.model is not replica:
            return False  # moved away after a refusal, or a confused worker: not its request
        if seq.finish_reason != model_worker_pb2.FINISH_REASON_ERROR:
            return True
        if self.metrics is not None:
            self.metrics.model_worker_rpc_errors.labels(worker=replica.address, rpc="AddRequest",
                                                        code=_STATUS_NAMES.get(seq.error.code, "UNKNOWN")).inc()
        if seq.error.code != _RESOURCE_EXHAUSTED:
            return True
        replica.full_until = time.monotonic() + RETRY_AFTER_S
        request.models_full.append(replica)
        other = self.model_workers.pick(exclude=request.models_full)
        if other is None:
            return True  # every replica is full: the 429 goes to the client
        self._add_on(request, other)
        return False

    @staticmethod
    def _add_on(request: _LiveRequest, other: ModelWorkerClient) -> None:
        """Moves a request that has not run (or whose replica is gone) to `other`, from the start."""
        request.model.num_sequences -= len(request.states)
        other.num_sequences += len(request.states)
        request.model = other
        other.add(add_request(request.request_id, request.prompt_token_ids, request.params))

    def _on_token_frame(self, frame: model_worker_pb2.TokenFrame) -> None:
        """Records every sequence's tokens and forwards them as one DetokenizeFrame per replica."""
        opens: dict[DetokClient, list[detok_worker_pb2.OpenSequence]] = {}
        tokens: dict[DetokClient, list[detok_worker_pb2.SequenceTokenIds]] = {}
        rows: dict[DetokClient, list[ColumnRow]] = {}
        for seq in frame.sequences:
            request = self._live.get(seq.request_id)
            if request is None:
                continue  # aborted or ended by stop strings; the worker has not heard yet
            request.model_replied = True
            try:
                self._take_sequence_tokens(request, seq, opens, tokens, rows)
            except Exception as exc:
                # One request that cannot be forwarded fails alone: the frame holds every
                # other request's tokens too.
                logger.exception("request %s: forwarding its tokens failed", request.request_id)
                self._fail(request, APIError(500, f"the gateway could not forward this request's tokens: {exc!r}"))
        for detok in tokens.keys() | opens.keys() | rows.keys():
            detok.send(opens.get(detok, ()), tokens.get(detok, ()), rows.get(detok, ()))

    def _take_sequence_tokens(self, request: _LiveRequest, seq: model_worker_pb2.SequenceTokens,
                              opens: dict[DetokClient, list[detok_worker_pb2.OpenSequence]],
                              tokens: dict[DetokClient, list[detok_worker_pb2.SequenceTokenIds]],
                              rows: dict[DetokClient, list[ColumnRow]]) -> None:
        """One sequence of a TokenFrame: its request's state, and what goes to its detok replica."""
        if (seq.finish_reason == model_worker_pb2.FINISH_REASON_ABORT and 0 <= seq.index < len(request.states)
                and request.states[seq.index].finished):
            # The answer to abort_outputs: this output stopped at a stop string, the others go on.
            request.states[seq.index].model_finish_reason = seq.finish_reason
            request.model_finished = all(s.model_finished for s in request.states)
            return
        if seq.finish_reason in (model_worker_pb2.FINISH_REASON_ERROR, model_worker_pb2.FINISH_REASON_ABORT):
            request.model_finished = True
            if seq.finish_reason == model_worker_pb2.FINISH_REASON_ERROR:
                error = from_grpc_code(seq.error.code, seq.error.message,
                                       request.params.params_of_fields.get(seq.error.field))
            else:
                error = workers_unavailable("the model worker aborted the request")
            self._fail(request, error)
            return
        if not 0 <= seq.index < len(request.states):
            request.model_finished = True  # a worker this confused is not asked to abort
            self._fail(request, APIError(502, f"the model worker sent output {seq.index} of a request "
                                              f"for {len(request.states)}"))
            return
        if seq.prompt_logprobs:
            prompt_logprobs = prompt_logprobs_of(seq)
            for state in request.states:
                state.prompt_logprobs = prompt_logprobs
        state = request.states[seq.index]
        state.record_tokens(seq)
        request.model_finished = all(s.model_finished for s in request.states)
        if state.finished:
            return  # a stop string ended this output; the others go on
        if not state.detok_opened and not request.detok.connected:
            # Its replica started draining (or went) while the request waited for its first
            # token: its sequences open on another one instead.
            self._move_unopened(request)
        detok = request.detok
        renders = self._renders_in_stream(request)
        text_ids = seq.token_ids
        if seq.HasField("stop_token_id"):
            if seq.stop_token_id in request.params.stop_token_ids:
                state.stop_reason = seq.stop_token_id  # eos is no stop_reason (vLLM's rule)
            if not request.params.include_stop_str_in_output and len(text_ids) >= 4:
                # The stop token (a stop_token_ids entry, or eos; the last int32 of the packed ids)
                # counts in usage and logprobs but not in the text, as in vLLM: "<|im_end|>" with
                # skip_special_tokens off, or a plain-word stop id.
                text_ids = text_ids[:-4]
        if not state.detok_opened:
            # Opened with its first tokens: a request the model worker refuses never
            # costs the detok worker anything.
            opens.setdefault(detok, []).append(self._open_sequence(request, state, renders))
            state.detok_opened = True
        state.text_ids_sent += text_ids
        if not renders and detok.has_handle(state.request_id):
            rows.setdefault(detok, []).append((state.request_id, text_ids, state.model_finished))
            return
        entry = detok_worker_pb2.SequenceTokenIds(sequence_id=state.request_id, token_ids=text_ids,
                                                  finished=state.model_finished)
        if renders:
            render_ids = logprob_ids(seq)
            entry.render_token_ids = pack_int32(render_ids)
            state.pending_render_ids.extend(render_ids)
        tokens.setdefault(detok, []).append(entry)

    def _on_text_delta_frame(self, detok: DetokClient, frame: detok_worker_pb2.TextDeltaFrame) -> None:
        for delta in frame.deltas:
            self._on_text_delta(detok, delta.sequence_id, delta)
        columns = frame.columns
        if columns.handles:
            # Plain text of handled sequences: each entry reads as a TextDelta with text and
            # num_tokens only (not finished, no stop, no error, nothing rendered).
            names = detok.sequence_of_handle
            text = columns.text
            offset = 0
            for handle, length, num_tokens in zip(unpack_int32(columns.handles).tolist(),
                                                  unpack_int32(columns.text_lengths).tolist(),
                                                  unpack_int32(columns.num_tokens).tolist(), strict=True):
                name = names[handle] if 0 < handle < len(names) else None
                if name is not None:
                    self._on_text_delta(detok, name, detok_worker_pb2.TextDelta(
                        text=text[offset:offset + length].decode("utf-8"), num_tokens=num_tokens, stop_index=-1))
                offset += length

    def _on_text_delta(self, detok: DetokClient, sequence_id: str, delta: detok_worker_pb2.TextDelta) -> None:
        """One sequence's reply: a TextDelta, or a TextColumns entry made into one."""
        found = self._sequences.get(sequence_id)
        if found is None or found[0].detok is not detok:
            return
        request, choice = found
        state = request.states[choice]
        if delta.finished:  # the worker forgot the sequence: its handle may take another
            request.detok.sequence_finished(sequence_id)
        if delta.rendered.text and self.renderer is not None:
            num_rendered = len(delta.rendered.text)
            self.renderer.absorb(state.pending_render_ids[:num_rendered], delta.rendered)
            del state.pending_render_ids[:num_rendered]
        if delta.error:
            state.finished = True
            if self.metrics is not None:
                self.metrics.detok_rpc_errors.labels(worker=request.detok.address, rpc="Detokenize").inc()
            self._fail(request, APIError(500, f"detokenizing failed: {delta.error}"))
            return
        if state.skip_text_chars and delta.text:
            # Reopened on this replica after another was lost: text the client already has.
            cut = min(state.skip_text_chars, len(delta.text))
            state.skip_text_chars -= cut
            delta.text = delta.text[cut:]
        if not delta.text and not delta.finished:
            # Text held back (half a character, a possible stop string): its tokens ride
            # with the next text.
            state.num_accounted += delta.num_tokens
            return
        if (request.params.prompt_logprobs is not None and state.prompt_logprobs is None
                and state.num_events == 0):
            # Asked for and not sent: a model worker without prompt logprobs ignored the field.
            self._fail(request, APIError(400, "this model worker does not return prompt logprobs "
                                              "(prompt_logprobs, or echo with logprobs)",
                                         param="prompt_logprobs"))
            return
        if 0 <= delta.stop_index < len(request.params.stop):
            state.stop_reason = request.params.stop[delta.stop_index]
        event = state.take_event(delta)
        if delta.finished:
            self._sequences.pop(state.request_id, None)
            if all(s.finished for s in request.states):
                # A stop string may have ended the text early: the model worker need not go on.
                self._end(request)
            elif delta.stop_index >= 0 and not state.model_finished:
                # One of n choices hit a stop string: it alone stops computing on the model worker.
                request.model.abort_outputs(request.request_id, [choice])
        request.events.put_nowait((choice, event))

    def _on_model_lost(self, replica: ModelWorkerClient, error: Exception) -> None:
        if self.metrics is not None:
            code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else "STREAM_ENDED"
            self.metrics.model_worker_rpc_errors.labels(worker=replica.address, rpc="Generate", code=code).inc()
        for request in list(self._live.values()):
            if request.model is not replica or request.model_finished:
                # Other replicas carry on; a request whose every output has ended on the model
                # worker only waits for its last text from the detok worker (a draining worker
                # ends its streams right after their requests' last frames).
                continue
            if self._move_unanswered(request, replica):
                continue
            request.model_finished = True  # the lost stream took the request with it
            self._fail(request, workers_unavailable(f"lost the model worker stream ({why_lost(error)})"))

    def _move_unanswered(self, request: _LiveRequest, lost: ModelWorkerClient) -> bool:
        """Adds a request the lost replica never answered (queued there, or racing its drain) to
        another replica: nothing of it reached the client, so it runs there from the start rather
        than fail with 503. False where it has been answered or no other replica is connected."""
        if request.model_replied:
            return False
        other = self.model_workers.pick(exclude=[lost, *request.models_full])
        if other is None:
            return False
        self._add_on(request, other)
        return True

    def _renders_in_stream(self, request: _LiveRequest) -> bool:
        """Its logprob tokens' strings come with its text (render_token_ids), so its ids go as
        per-sequence entries; otherwise as TokenColumns rows, its plain text back in columns."""
        return bool(request.params.logprobs and self.renderer is not None and self.renderer.renders_in_stream)

    def _open_sequence(self, request: _LiveRequest, state: RequestState, renders: bool) -> detok_worker_pb2.OpenSequence:
        """The OpenSequence of one output on request.detok, with a handle unless it renders."""
        open_ = open_sequence(state.request_id, self.model_info.tokenizer, request.prompt_token_ids, request.params)
        if not renders:
            request.detok.assign_handle(open_)
        return open_

    def _move_to_other_detok(self, request: _LiveRequest) -> bool:
        """Places the request on the least loaded other detok replica that takes new sequences;
        False if there is none."""
        moved_to = self.detok_pool.pick(exclude=[request.detok])
        if moved_to is None:
            return False
        request.detok.num_open_sequences -= len(request.states)
        moved_to.num_open_sequences += len(request.states)
        request.detok = moved_to
        return True

    def _move_unopened(self, request: _LiveRequest) -> bool:
        """Moves a request still waiting for its first token (no detok sequence opened yet) to
        another replica; False if it cannot move."""
        return not any(state.detok_opened for state in request.states) and self._move_to_other_detok(request)

    def _reopen_elsewhere(self, request: _LiveRequest) -> bool:
        """Moves a request off a lost detok replica, reopening the sequences it had there: each
        with every id it was sent for text (and the ids still to render), its text then skipped up
        to what the client has been given. Decoding is deterministic, so the client reads on where
        it was. Outputs not opened yet open there with their first tokens. False if no other
        replica takes new sequences."""
        lost = request.detok
        if not self._move_to_other_detok(request):
            return False
        moved_to = request.detok
        renders = self._renders_in_stream(request)
        opens, entries, rows = [], [], []
        for state in request.states:
            if state.finished or not state.detok_opened:
                continue
            state.num_accounted = 0  # the new replica counts the replayed ids from the first
            state.skip_text_chars = state.num_text_chars
            opens.append(self._open_sequence(request, state, renders))
            ids = bytes(state.text_ids_sent)
            if moved_to.has_handle(state.request_id):
                rows.append((state.request_id, ids, state.model_finished))
            else:
                entry = detok_worker_pb2.SequenceTokenIds(sequence_id=state.request_id, token_ids=ids,
                                                          finished=state.model_finished)
                if renders:
                    entry.render_token_ids = pack_int32(state.pending_render_ids)
                entries.append(entry)
        if not opens:
            return True  # nothing of it was on the lost stream
        moved_to.send(opens, entries, rows)
        if self.metrics is not None:
            self.metrics.detok_sequences_reopened.labels(worker=moved_to.address).inc(len(opens))
        logger.info("request %s: its detok replica %s was lost; %d sequence(s) reopened on %s", request.request_id,
                    lost.address, len(opens), moved_to.address)
        return True

    def _on_detok_lost(self, lost: DetokClient, error: Exception) -> None:
        if self.metrics is not None:
            self.metrics.detok_rpc_errors.labels(worker=lost.address, rpc="Detokenize").inc()
        for request in list(self._live.values()):
            if request.detok is not lost:
                continue
            if self._reopen_elsewhere(request):
                continue
            for state in request.states:
                state.finished = True  # nothing to close on a stream that is gone
            self._fail(request, workers_unavailable(f"lost the detok worker stream ({why_lost(error)})"))


def logprob_ids(seq: model_worker_pb2.SequenceTokens) -> list[int]:
    """Each new token's id followed by its top alternatives' ids, row-major: what its logprobs show."""
    chosen = unpack_int32(seq.token_ids)  # [num_new_tokens]
    k = seq.num_top_logprobs
    if k <= 0 or not seq.top_token_ids:
        return chosen.tolist()
    top = unpack_int32(seq.top_token_ids).reshape(-1, k)  # [num_new_tokens, k]
    return [t for c, row in zip(chosen.tolist(), top.tolist(), strict=True) for t in (c, *row)]
