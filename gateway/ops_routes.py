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
from gateway.openai_requests import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    template_tools_of,
)
from gateway.pipeline import Pipeline
from gateway.prompt_tokenizer import PromptTokenizer, off_loop_if_large
from gateway.request_mapping import chat_messages_of, check_token_ids
from gateway.token_rendering import TokenRenderer
from tokenwire.v1.model_worker_pb2 import WorkerLoad

# Readiness and scrapes must answer quickly even when a worker hangs (deploy/k8s/gateway.yaml's
# readiness probe and compose.yaml's healthcheck give /ready more than this).
PROBE_TIMEOUT_S = 2.0


def pipeline_for(request: Request, model: str | None) -> Pipeline:
    """The pipeline serving `model`; 404 in OpenAI's words for any other name (None or "": the one served)."""
    served = request.app.state.served_model_name
    if model and model != served:  # "" too: vLLM serves it the default model
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
        """Readiness: at least one model worker replica has its stream open and answers GetLoad, and
        at least one detok replica's stream is up; the body (or the 503's message) lists the
        replicas that take no new work, and each answering replica's queue."""
        pipeline: Pipeline = request.app.state.pipeline
        loads, down = await _replica_loads(pipeline, request.app.state.metrics)
        detoks_up = [d.address for d in pipeline.detok_pool.live if d.connected]
        down += [f"detok worker {d.address} ({d.refusal or ('draining' if d.stream.connected else 'stream down')})"
                 for d in pipeline.detok_pool.live if not d.connected]
        if not loads or not detoks_up:
            missing = "no model worker replica" if not loads else "no detok replica"
            raise workers_unavailable(f"not ready: {missing} is connected; down: {'; '.join(down)}")
        body: dict[str, Any] = {"status": "ready", "model": pipeline.model_info.model_id,
                                "model_workers": sorted(loads), "detok_workers": detoks_up, "down": down}
        body["load"] = {address: {"num_running": load.num_running, "num_waiting": load.num_waiting,
                                  "max_waiting": load.max_waiting, "max_num_seqs": load.max_num_seqs,
                                  "kv_blocks_used": load.kv_blocks_used, "kv_blocks_total": load.kv_blocks_total}
                        for address, load in loads.items() if load is not None}
        return body

    @router.get("/metrics", response_class=Response,
                responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                                 "description": "Prometheus text exposition"}})
    async def metrics(request: Request) -> Response:
        pipeline: Pipeline = request.app.state.pipeline
        m: GatewayMetrics = request.app.state.metrics
        m.num_requests_live.set(pipeline.num_live_requests)
        await _replica_loads(pipeline, m)  # failures are counted; the other series are still worth a scrape
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize", responses=error_responses)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        """vLLM's shape: a prompt (or chat messages, through the chat template) to token ids."""
        pipeline = pipeline_for(request, body.model)
        tokenizer = tokenizer_of(pipeline)
        if body.messages is not None:
            ids = await tokenizer.encode_chat_async(chat_messages_of(body.messages), body.add_generation_prompt,
                                                    body.continue_final_message, body.template_kwargs(),
                                                    template_tools_of(body.tools), body.documents)
        else:
            assert body.prompt is not None, "validated: exactly one of prompt and messages"
            ids = await tokenizer.encode_text_async(body.prompt, add_special_tokens=body.add_special_tokens)

        def answer() -> str:
            return TokenizeResponse(count=len(ids), max_model_len=pipeline.model_info.max_model_len, tokens=ids,
                                    token_strs=tokenizer.vocabulary_tokens(ids) if body.return_token_strs
                                    else None).model_dump_json()
        return _json(await off_loop_if_large(len(ids), INLINE_ANSWER_MAX_TOKENS, answer))

    @router.post("/detokenize", responses=error_responses)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        pipeline = pipeline_for(request, body.model)
        check_token_ids(body.tokens, pipeline.prompt_vocab_size, param="tokens")
        tokenizer = tokenizer_of(pipeline)
        return _json(await off_loop_if_large(
            len(body.tokens), INLINE_ANSWER_MAX_TOKENS,
            lambda: DetokenizeResponse(prompt=tokenizer.decode(body.tokens)).model_dump_json()))

    # HEAD too, as some load balancers probe (405 before); out of the OpenAPI document, where it
    # would repeat the GET's operationId.
    for path, endpoint in (("/health", health), ("/ready", ready)):
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
    return router


# Token lists up to this long are spelled and answered on the event loop; longer ones on a worker
# thread, so other requests' streams go on meanwhile (a 27 MB /tokenize answer with token_strs
# held every stream for 1.4 s). About INLINE_ENCODE_MAX_CHARS' worth of tokens.
INLINE_ANSWER_MAX_TOKENS = 1024


def _json(body: str) -> Response:
    return Response(body, media_type="application/json")


async def _replica_loads(pipeline: Pipeline,
                         metrics: GatewayMetrics) -> tuple[dict[str, WorkerLoad | None], list[str]]:
    """Each connected model worker replica's WorkerLoad (None from one without GetLoad), by address,
    with the per-replica gauges set from them; and why each other replica is down. A replica whose
    GetLoad fails is counted as down."""
    replicas = pipeline.model_workers.live
    connected = [r for r in replicas if r.connected]
    answers = await asyncio.gather(*(r.get_load(PROBE_TIMEOUT_S) for r in connected), return_exceptions=True)
    metrics.clear_replicas()
    for replica in replicas:
        metrics.model_worker_sequences.labels(worker=replica.address).set(replica.num_sequences)
        metrics.model_worker_connected.labels(worker=replica.address).set(int(replica.connected))
    loads: dict[str, WorkerLoad | None] = {}
    down = pipeline.model_workers.down()
    for replica, answer in zip(connected, answers, strict=True):
        if isinstance(answer, WorkerLoad):
            metrics.set_load(replica.address, answer)
            loads[replica.address] = answer
        elif isinstance(answer, grpc.aio.AioRpcError) and answer.code() == grpc.StatusCode.UNIMPLEMENTED:
            loads[replica.address] = None  # a worker without GetLoad yet
        elif isinstance(answer, grpc.aio.AioRpcError):
            metrics.model_worker_rpc_errors.labels(worker=replica.address, rpc="GetLoad",
                                                   code=answer.code().name).inc()
            down.append(f"model worker {replica.address} (does not answer GetLoad: {answer.code().name})")
        else:
            raise answer
    return loads, down
