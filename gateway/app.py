"""The FastAPI app: OpenAI routes over the Pipeline, JSON or server-sent events out.

__main__ serves create_app(config) with uvicorn; the lifespan connects the worker streams
before the first request and closes them at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.config import Config
from gateway.errors import APIError, install_error_handlers, workers_unavailable
from gateway.openai_schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.pipeline import Pipeline
from gateway.prompt_tokenizer import PromptTokenizer
from gateway.request_mapping import (
    GenerationParams,
    chat_messages,
    chat_params,
    check_context_length,
    check_token_ids,
    completion_params,
    completion_prompt,
)
from gateway.request_state import GenerationEvent
from gateway.responses import (
    ChatResponder,
    ChoiceEvents,
    ChoiceOutput,
    CompletionResponder,
    Responder,
    sse_stream,
)

logger = logging.getLogger(__name__)


def create_app(config: Config) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pipeline = await Pipeline.connect(config)
        app.state.pipeline = pipeline
        app.state.served_model_name = config.served_model_name or pipeline.model_info.model_id
        app.state.created = int(time.time())
        logger.info("serving %s", app.state.served_model_name)
        try:
            yield
        finally:
            await pipeline.close()

    app = FastAPI(title="tokenwire gateway", lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> Response:
        pipeline: Pipeline = request.app.state.pipeline
        if not pipeline.ready:
            raise workers_unavailable("a worker stream is down; reconnecting")
        return JSONResponse({"status": "ok", "live_requests": pipeline.num_live_requests})

    @app.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        pipeline: Pipeline = request.app.state.pipeline
        return ModelList(data=[ModelCard(id=request.app.state.served_model_name, created=request.app.state.created,
                                         max_model_len=pipeline.model_info.max_model_len)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        pipeline = _pipeline_for(request, body.model)
        tokenizer = _tokenizer(pipeline)
        prompt_ids = tokenizer.encode_chat(chat_messages(body))
        responder = ChatResponder(body.model, tokenizer, body.logprobs)
        return await _respond(request, pipeline, prompt_ids, chat_params(body), body.n, body.stream,
                              body.include_usage, responder)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        pipeline = _pipeline_for(request, body.model)
        tokenizer = _tokenizer(pipeline)
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode_text(prompt)
        else:
            prompt_ids = prompt
        check_token_ids(prompt_ids, pipeline.model_info.vocab_size)
        responder = CompletionResponder(body.model, tokenizer, body.logprobs is not None, body.n)
        return await _respond(request, pipeline, prompt_ids, completion_params(body), body.n, body.stream,
                              body.include_usage, responder)

    return app


def _pipeline_for(request: Request, model: str) -> Pipeline:
    served = request.app.state.served_model_name
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist. This gateway serves `{served}`.",
                       param="model", code="model_not_found")
    return request.app.state.pipeline


def _tokenizer(pipeline: Pipeline) -> PromptTokenizer:
    assert pipeline.tokenizer is not None, "the lifespan loads it before serving"
    return pipeline.tokenizer


async def _respond(request: Request, pipeline: Pipeline, prompt_ids: Sequence[int], params: GenerationParams,
                   n: int, stream: bool, include_usage: bool, responder: Responder) -> Response:
    check_context_length(len(prompt_ids), params.max_tokens, pipeline.model_info.max_model_len)
    events = _merge_choices([pipeline.generate(prompt_ids, params.for_choice(i)) for i in range(n)])
    if not stream:
        outputs = await _collect_unless_disconnected(request, events, n)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(responder.response(outputs, len(prompt_ids)).model_dump())
    # The first event is awaited before the headers go out, so a refusal by the model worker
    # (429, 400) still gets its own HTTP status instead of an error event in a 200 stream.
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(sse_stream(first, events, responder, n, include_usage, len(prompt_ids)),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merge_choices(choices: list[AsyncGenerator[GenerationEvent, None]]) -> ChoiceEvents:
    """(choice index, event) pairs from n choices in arrival order; closing it aborts them all."""
    if len(choices) == 1:
        async with aclosing(choices[0]) as only:
            async for event in only:
                yield 0, event
        return
    merged: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, choice: AsyncIterator[GenerationEvent]) -> None:
        try:
            async for event in choice:
                merged.put_nowait((index, event))
            merged.put_nowait((index, None))
        except Exception as exc:
            merged.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item = await merged.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each choice's generator aborts its request as it unwinds
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (uvicorn sends it
    # when the client goes, or after the response is complete).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_disconnected(request: Request, events: ChoiceEvents, n: int) -> list[ChoiceOutput] | None:
    """Every choice's full output, or None when the client left first (its requests are aborted)."""
    outputs = [ChoiceOutput() for _ in range(n)]

    async def collect() -> None:
        async with aclosing(events):
            async for index, event in events:
                outputs[index].add(event)

    collector = asyncio.create_task(collect())
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
        await asyncio.gather(collector, watcher, return_exceptions=True)
    if collector.cancelled():
        return None
    collector.result()  # raises the choice's APIError
    return outputs
