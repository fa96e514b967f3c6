"""Per-request orchestration: prompt ids → model worker → detok worker → GenerationEvents.

app.py calls Pipeline.generate for each choice; the model worker's reader forwards every
TokenFrame in bulk (one DetokenizeFrame per detok replica) and the detok readers push the text
deltas into the per-request queues that generate() drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from gateway.config import Config
from gateway.detok_client import DetokClient
from gateway.errors import APIError, from_grpc_code, workers_unavailable
from gateway.model_worker_client import ModelWorkerClient
from gateway.prompt_tokenizer import PromptTokenizer
from gateway.request_mapping import GenerationParams, add_request, open_sequence
from gateway.request_state import GenerationEvent, RequestState
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.v1 import detok_worker_pb2, model_worker_pb2

logger = logging.getLogger(__name__)


@dataclass
class _LiveRequest:
    state: RequestState
    params: GenerationParams
    prompt_token_ids: Sequence[int]
    detok: DetokClient
    events: asyncio.Queue[GenerationEvent | APIError]


class Pipeline:
    """Owns the worker streams and the table of live requests both readers dispatch into."""

    def __init__(self, config: Config, model_channel: grpc.aio.Channel,
                 detok_channels: Sequence[grpc.aio.Channel]) -> None:
        self.config = config
        self._channels = [model_channel, *detok_channels]
        self.model = ModelWorkerClient(model_channel, self._on_token_frame, self._on_model_lost)
        self.detoks = [DetokClient(i, address, channel, self._on_text_delta_frame, self._on_detok_lost)
                       for i, (address, channel) in enumerate(zip(config.detok_workers, detok_channels, strict=True))]
        self._live: dict[str, _LiveRequest] = {}
        self.model_info = model_worker_pb2.ModelInfo()
        self.tokenizer: PromptTokenizer | None = None

    @classmethod
    async def connect(cls, config: Config) -> Pipeline:
        """Waits (up to config.startup_timeout_s) for both kinds of worker, then opens the streams."""
        model_channel = grpc.aio.insecure_channel(config.model_worker, options=CHANNEL_OPTIONS)
        detok_channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in config.detok_workers]
        pipeline = cls(config, model_channel, detok_channels)
        try:
            await pipeline._start()
        except BaseException:
            await pipeline.close()
            raise
        return pipeline

    async def _start(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        self.model_info = await self.model.get_model_info(self.config.startup_timeout_s)
        logger.info("model worker serves %s (max_model_len %d)", self.model_info.model_id,
                    self.model_info.max_model_len)
        self.tokenizer = await asyncio.to_thread(
            PromptTokenizer.load, self.model_info.tokenizer, self.model_info.chat_template)
        for client in [self.model, *self.detoks]:
            await client.stream.start(max(deadline - time.monotonic(), 1.0))

    async def close(self) -> None:
        for request in list(self._live.values()):
            self._fail(request, workers_unavailable("the gateway is shutting down"))
        await asyncio.gather(self.model.stream.close(), *(d.stream.close() for d in self.detoks))
        await asyncio.gather(*(channel.close() for channel in self._channels))

    @property
    def ready(self) -> bool:
        return self.model.connected and all(d.connected for d in self.detoks)

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    async def generate(self, prompt_token_ids: Sequence[int],
                       params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """Events of one choice until its finish_reason; raises APIError when it fails.

        Leaving early (client gone, task cancelled) aborts it on the model worker and closes
        its detok sequence.
        """
        if not self.model.connected:
            raise workers_unavailable("the model worker is not connected")
        detok = self._pick_detok()
        request_id = uuid.uuid4().hex
        request = _LiveRequest(RequestState(request_id, len(prompt_token_ids)), params, prompt_token_ids,
                               detok, asyncio.Queue())
        self._live[request_id] = request
        detok.num_open_sequences += 1
        self.model.add(add_request(request_id, prompt_token_ids, params))
        try:
            while True:
                item = await request.events.get()
                if isinstance(item, APIError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if self._live.pop(request_id, None) is not None:
                self._abort(request)
            detok.num_open_sequences -= 1

    def _pick_detok(self) -> DetokClient:
        connected = [d for d in self.detoks if d.connected]
        if not connected:
            raise workers_unavailable("no detok worker is connected")
        return min(connected, key=lambda d: d.num_open_sequences)

    def _abort(self, request: _LiveRequest) -> None:
        """Stops a request the client no longer wants, on both workers."""
        state = request.state
        if not state.model_finished:
            self.model.abort(state.request_id)
        if state.detok_opened and not state.finished:
            request.detok.close_sequence(state.request_id)

    def _fail(self, request: _LiveRequest, error: APIError) -> None:
        self._live.pop(request.state.request_id, None)
        request.events.put_nowait(error)

    # ---- reader callbacks: run on the event loop, never await ----

    def _on_token_frame(self, frame: model_worker_pb2.TokenFrame) -> None:
        """Records every sequence's tokens and forwards them as one DetokenizeFrame per replica."""
        opens: dict[int, list[detok_worker_pb2.OpenSequence]] = {}
        tokens: dict[int, list[detok_worker_pb2.SequenceTokenIds]] = {}
        for seq in frame.sequences:
            request = self._live.get(seq.request_id)
            if request is None:
                continue  # aborted or ended by a stop string; the worker has not heard yet
            state = request.state
            if seq.finish_reason in (model_worker_pb2.FINISH_REASON_ERROR, model_worker_pb2.FINISH_REASON_ABORT):
                state.model_finish_reason = seq.finish_reason
                if state.detok_opened:
                    request.detok.close_sequence(state.request_id)
                if seq.finish_reason == model_worker_pb2.FINISH_REASON_ERROR:
                    error = from_grpc_code(seq.error.code, seq.error.message)
                else:
                    error = workers_unavailable("the model worker aborted the request")
                self._fail(request, error)
                continue
            state.record_tokens(seq)
            index = request.detok.index
            if not state.detok_opened:
                # Opened with its first tokens: a request the model worker refuses never
                # costs the detok worker anything.
                state.detok_opened = True
                opens.setdefault(index, []).append(open_sequence(
                    state.request_id, self.model_info.tokenizer, request.prompt_token_ids, request.params))
            tokens.setdefault(index, []).append(detok_worker_pb2.SequenceTokenIds(
                sequence_id=state.request_id, token_ids=seq.token_ids, finished=state.model_finished))
        for index in tokens.keys() | opens.keys():
            self.detoks[index].send(opens.get(index, ()), tokens.get(index, ()))

    def _on_text_delta_frame(self, index: int, frame: detok_worker_pb2.TextDeltaFrame) -> None:
        for delta in frame.deltas:
            request = self._live.get(delta.sequence_id)
            if request is None or request.detok.index != index:
                continue
            state = request.state
            if delta.error:
                state.finished = True
                if not state.model_finished:
                    self.model.abort(state.request_id)
                self._fail(request, APIError(500, f"detokenizing failed: {delta.error}"))
                continue
            if not delta.text and not delta.finished:
                continue
            event = state.take_event(delta)
            if delta.finished:
                del self._live[state.request_id]
                if not state.model_finished:
                    # A stop string ended the text: the model worker need not go on.
                    self.model.abort(state.request_id)
            request.events.put_nowait(event)

    def _on_model_lost(self, error: Exception) -> None:
        for request in list(self._live.values()):
            if request.state.detok_opened and not request.state.finished:
                request.detok.close_sequence(request.state.request_id)
            request.state.model_finish_reason = model_worker_pb2.FINISH_REASON_ABORT
            self._fail(request, workers_unavailable(f"lost the model worker stream: {error}"))

    def _on_detok_lost(self, index: int, error: Exception) -> None:
        for request in list(self._live.values()):
            if request.detok.index != index:
                continue
            request.state.finished = True
            if not request.state.model_finished:
                self.model.abort(request.state.request_id)
            self._fail(request, workers_unavailable(f"lost the detok worker stream: {error}"))
