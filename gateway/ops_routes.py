"""Routes beside the OpenAI API: liveness, readiness, Prometheus metrics, vLLM's /tokenize and /detokenize.

app.py includes ops_router(); pipeline_for, tokenizer_of and renderer_of, which every route
uses to reach the served model, live here so both route modules share them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.errors import APIError, workers_unavailable
from gateway.metrics import GatewayMetrics
from gateway.openai_requests import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from gateway.pipeline import Pipeline
from gateway.prompt_tokenizer import PromptTokenizer
from gateway.request_mapping import chat_messages_of, check_token_ids
from gateway.token_rendering import TokenRenderer

# Readiness and scrapes must answer quickly even when a worker hangs.
_PROBE_TIMEOUT_S = 2.0


def pipeline_for(request: Request, model: str | None) -> Pipeline:
    """The pipeline serving `model`; 404 in OpenAI's words for any other name (None: the one served)."""
    served = request.app.state.served_model_name
    if model is not None and model != served:
        raise APIError(404, f"The model `{model}` does not exist. This gateway serves `{served}`.",
                       param="model", code="model_not_found")
    return request.app.state.pipeline


def tokenizer_of(pipeline: Pipeline) -> PromptTokenizer:
    assert pipeline.tokenizer is not None, "the lifespan loads it before serving"
    return pipeline.tokenizer


def renderer_of(pipeline: Pipeline) -> TokenRenderer:
    assert pipeline.renderer is not None, "the lifespan makes it before serving"
    return pipeline.renderer


def ops_router(error_responses: dict[int | str, dict[str, Any]]) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness: the gateway process answers (readiness is /ready)."""
        pipeline: Pipeline = request.app.state.pipeline
        return {"status": "ok", "live_requests": pipeline.num_live_requests}

    @router.get("/ready", responses={503: error_responses[503]})
    async def ready(request: Request) -> dict[str, Any]:
        """Readiness: both worker streams are open, the model worker answers GetModelInfo (its
        model is loaded) and GetLoad, every detok replica's stream is up."""
        pipeline: Pipeline = request.app.state.pipeline
        down = [d.address for d in pipeline.detoks if not d.connected]
        if down:
            raise workers_unavailable(f"detok worker stream down: {', '.join(down)}")
        if not pipeline.model.connected:
            raise workers_unavailable("the model worker stream is down")
        try:
            info, load = await asyncio.gather(pipeline.model.get_model_info(_PROBE_TIMEOUT_S),
                                              _load_or_none(pipeline, request.app.state.metrics))
        except grpc.aio.AioRpcError as exc:
            raise workers_unavailable(f"the model worker does not answer: {exc.code().name}") from exc
        body: dict[str, Any] = {"status": "ready", "model": info.model_id, "detok_workers": len(pipeline.detoks)}
        if load is not None:
            body["load"] = {"num_running": load.num_running, "num_waiting": load.num_waiting,
                            "max_waiting": load.max_waiting, "kv_blocks_used": load.kv_blocks_used,
                            "kv_blocks_total": load.kv_blocks_total}
        return body

    @router.get("/metrics", response_class=Response,
                responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                                 "description": "Prometheus text exposition"}})
    async def metrics(request: Request) -> Response:
        pipeline: Pipeline = request.app.state.pipeline
        m: GatewayMetrics = request.app.state.metrics
        m.num_requests_live.set(pipeline.num_live_requests)
        try:
            await _load_or_none(pipeline, m)
        except grpc.aio.AioRpcError:
            pass  # counted; the other series are still worth a scrape
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize", responses=error_responses)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        """vLLM's shape: a prompt (or chat messages, through the chat template) to token ids."""
        pipeline = pipeline_for(request, body.model)
        tokenizer = tokenizer_of(pipeline)
        if body.messages is not None:
            ids = tokenizer.encode_chat(chat_messages_of(body.messages), body.add_generation_prompt)
        else:
            assert body.prompt is not None, "validated: exactly one of prompt and messages"
            ids = tokenizer.encode_text(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=pipeline.model_info.max_model_len, tokens=ids,
                                token_strs=[tokenizer.token_text(t) for t in ids] if body.return_token_strs
                                else None)

    @router.post("/detokenize", responses=error_responses)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        pipeline = pipeline_for(request, body.model)
        check_token_ids(body.tokens, pipeline.model_info.vocab_size, param="tokens")
        return DetokenizeResponse(prompt=tokenizer_of(pipeline).decode(body.tokens))

    return router


async def _load_or_none(pipeline: Pipeline, metrics: GatewayMetrics) -> Any:
    """The model worker's WorkerLoad (and the gauges set from it), or None from a worker that
    has no GetLoad yet; other RPC failures are counted and raised."""
    try:
        load = await pipeline.model.get_load(_PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        metrics.model_worker_rpc_errors.labels(rpc="GetLoad", code=exc.code().name).inc()
        raise
    metrics.set_load(load)
    return load

