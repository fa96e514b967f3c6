"""The FastAPI app: OpenAI routes over the Pipeline, JSON or server-sent events out.

__main__ serves create_app(config) with uvicorn; the lifespan connects the worker streams
before the first request and closes them at shutdown. Health, readiness, metrics and the
tokenizer endpoints live in ops_routes.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from gateway.config import Config
from gateway.errors import APIError, install_error_handlers, invalid_request
from gateway.http_middleware import GatewayHTTPMiddleware, access_record
from gateway.metrics import GatewayMetrics, RequestTimer, metered
from gateway.openai_requests import ChatCompletionRequest, CompletionRequest
from gateway.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from gateway.ops_routes import ops_router, pipeline_for, renderer_of, tokenizer_of
from gateway.pipeline import Pipeline
from gateway.prompt_tokenizer import INLINE_ENCODE_MAX_CHARS, PromptTokenizer, off_loop_if_large
from gateway.reasoning_parsers import END as THINK_END
from gateway.reasoning_parsers import START as THINK_START
from gateway.reasoning_parsers import how_output_starts
from gateway.request_limits import check_request_limits, with_deadline
from gateway.request_mapping import (
    GenerationParams,
    chat_messages_of,
    check_context_length,
    check_params_vocab,
    check_token_ids,
    fitted_to,
    generation_params,
    truncate_prompt,
)
from gateway.request_state import GenerationEvent
from gateway.responses import (
    ChatResponder,
    ChoiceEvents,
    ChoiceOutput,
    CompletionResponder,
    PromptEcho,
    Responder,
    ToolCallMode,
    sse_stream,
)
from gateway.token_rendering import TokenIdLabels, TokenRenderer
from gateway.tool_parsers import TOOL_CALL_PARSERS
from tokenwire.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

T = TypeVar("T")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Bad parameters, or a prompt longer than the context"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when keys are configured)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "The model worker's queue is full; see Retry-After",
          "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}},
    503: {"model": ErrorResponse, "description": "A worker is unavailable"},
}


# One server-sent event, as OpenAPI 3.2 describes text/event-stream items (HTML's event fields);
# on 3.0/3.1 documents, `schema` is the per-event schema (what schemathesis checks each event of a
# stream against). `data` holds a chunk's JSON, an error object's, or [DONE].
SSE_EVENT_SCHEMA = {"type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                                   "retry": {"type": "integer", "minimum": 0}}}


def _generation_responses(full: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": full, "description": f"JSON, or with stream=true server-sent events: `data:` lines "
                                                f"of {chunk.__name__} (an error object if the stream fails "
                                                f"after it started), then `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}},
            **ERROR_RESPONSES}


def create_app(config: Config, freeze_heap: bool = False) -> FastAPI:
    """freeze_heap: once started, keep the process's heap out of later full garbage collections
    (tokenwire/gc_heap.py); for the gateway's own process, not for apps run inside another's."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # gateway.__main__ connects before uvicorn starts (where a signal can end the wait); an app
        # served otherwise connects here
        pipeline = getattr(app.state, "pipeline", None) or await Pipeline.connect(config, metrics)
        app.state.pipeline = pipeline
        app.state.served_model_name = config.served_model_name or pipeline.model_info.model_id
        metrics.describe_model(app.state.served_model_name, pipeline.model_info.max_model_len)
        app.state.created = int(time.time())
        if freeze_heap:  # the tokenizer and token tables are loaded by now
            freeze_startup_heap("gateway")
        logger.info("serving %s", app.state.served_model_name)
        try:
            yield
        finally:
            await pipeline.close()

    app = FastAPI(title="tokenwire gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat completions and completions over tokenwire's workers.")
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(GatewayHTTPMiddleware, api_keys=config.api_key, max_body_bytes=config.limits.max_body_bytes)
    app.state.limits = config.limits
    if config.cors_allow_origins:
        # Added last, so it is outermost: preflights are answered before the API key check.
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allow_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id", "retry-after"])
    app.include_router(ops_router(ERROR_RESPONSES))

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def list_models(request: Request) -> ModelList:
        pipeline: Pipeline = request.app.state.pipeline
        return ModelList(data=[ModelCard(id=request.app.state.served_model_name, created=request.app.state.created,
                                         max_model_len=pipeline.model_info.max_model_len)])

    @app.get("/v1/models/{model:path}", responses=ERROR_RESPONSES)
    async def retrieve_model(model: str, request: Request) -> ModelCard:
        """OpenAI's GET /v1/models/{model} (the SDK's models.retrieve): the served model's card, 404 otherwise
        (an empty name too, which a request body's "model" may leave for the served one, not a URL)."""
        if not model:
            raise APIError(404, "No model named in the URL: GET /v1/models/{model}, or /v1/models for the list.",
                           param="model", code="model_not_found")
        pipeline = pipeline_for(request, model)
        return ModelCard(id=model, created=request.app.state.created, max_model_len=pipeline.model_info.max_model_len)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_generation_responses(ChatCompletion, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_request_limits(body, request.app.state.limits)
        if body.lets_model_choose_tool() and not config.tool_call_parser:
            raise invalid_request('tool_choice "auto" (the default with tools) needs the gateway started with '
                                  '--tool-call-parser (the syntax the model writes calls in); send "required", '
                                  'a named function, or "none"', param="tool_choice")
        pipeline = pipeline_for(request, body.model)
        tokenizer = tokenizer_of(pipeline)
        tool_calls = ToolCallMode.of(body, config.tool_call_parser)
        if (tool_calls is not None and tool_calls.parser is not None
                and tokenizer.special_texts() & TOOL_CALL_PARSERS[tool_calls.parser].tags):
            # The tags are special tokens in some vocabularies: kept, or the parser would never
            # see a call (vLLM turns skip_special_tokens off whenever tools are parsed).
            body.skip_special_tokens = False
        if config.reasoning_parser and tokenizer.special_texts() & {THINK_START, THINK_END}:
            # The same for the think tags: dropped from the text, the parser would never see the
            # thinking end (and a deferred grammar's answer would be taken for thinking).
            body.skip_special_tokens = False
        prompt_ids = await tokenizer.encode_chat_async(chat_messages_of(body.messages), body.add_generation_prompt,
                                                       body.continue_final_message, body.template_kwargs(),
                                                       body.template_tools(config.exclude_tools_when_tool_choice_none),
                                                       body.documents)
        prompt_ids = truncate_prompt(prompt_ids, body.truncate_prompt_tokens, pipeline.model_info.max_model_len,
                                     body.completion_token_limit(), body.truncation_side)
        params = generation_params(body, tokenizer.encode_words, pipeline.model_info.generation_defaults)
        check_params_vocab(params, pipeline.model_info.vocab_size)
        model = body.model or request.app.state.served_model_name
        reasoning_parser = config.reasoning_parser or None
        prompt_tail = _prompt_tail(body, tokenizer) if reasoning_parser else ""
        constrained = params.structured_output is not None
        think_end_id = None
        start = how_output_starts(reasoning_parser, prompt_tail) if reasoning_parser and constrained else "answer"
        if start != "answer":
            # The constraint is on the answer: the thinking before it is free (vLLM's rule). The
            # model worker sees token ids, so it can find the end only where END is one token
            # (Qwen3's, R1's), and a maybe-opening only where START is; elsewhere the output is
            # constrained from its first token: unsplit where it would start in the thinking.
            end_ids, start_ids = tokenizer.encode_words(THINK_END), tokenizer.encode_words(THINK_START)
            if len(end_ids) == 1 and (start == "thinking" or len(start_ids) == 1):
                params.structured_output.after_token_ids[:] = end_ids
                if start == "maybe":
                    params.structured_output.opening_token_id = start_ids[0]
                think_end_id = end_ids[0]
            elif start == "thinking":
                reasoning_parser = None
        responder = ChatResponder(model, speller_for(body, pipeline), body.logprobs, body.include_usage, prompt_ids,
                                  tool_calls, reasoning_parser, prompt_tail, constrained, think_end_id,
                                  body.echo_text())
        responder.continuous_usage = body.continuous_usage
        responder.return_token_ids = body.return_token_ids
        return await _respond(request, pipeline, [prompt_ids], params, body.stream, responder, "messages")

    @app.post("/v1/completions", response_model=None, responses=_generation_responses(Completion, Completion))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request_limits(body, request.app.state.limits)
        pipeline = pipeline_for(request, body.model)
        tokenizer = tokenizer_of(pipeline)
        prompts = body.prompts()
        params = generation_params(body, tokenizer.encode_words, pipeline.model_info.generation_defaults)
        check_params_vocab(params, pipeline.model_info.vocab_size)
        # Before any prompt is tokenized: a batch of 200,000 one-character prompts was tokenized
        # (4.3 s of the event loop, every stream stalled) only to be refused then (review 87).
        await _check_batch_fits(pipeline, len(prompts), body.n)
        # The whole batch's size decides: 1000 prompts of 4000 characters, each short enough to
        # encode inline, held the event loop 3.3 s.
        size = sum(len(p) for p in prompts)
        echoes = await off_loop_if_large(size, INLINE_ENCODE_MAX_CHARS, _prompt_echoes, prompts, body, tokenizer,
                                         pipeline.prompt_vocab_size, pipeline.model_info.max_model_len)
        model = body.model or request.app.state.served_model_name
        responder = CompletionResponder(model, speller_for(body, pipeline), body.logprobs is not None, echoes,
                                        n=body.n, echo=body.echo, include_usage=body.include_usage,
                                        num_top_logprobs=body.logprobs or 0,
                                        prompt_logprobs=body.prompt_logprobs is not None,
                                        skipped_ids=tokenizer.special_ids if body.skip_special_tokens else frozenset(),
                                        special_ids=tokenizer.special_ids)
        responder.continuous_usage = body.continuous_usage
        responder.return_token_ids = body.return_token_ids
        return await _respond(request, pipeline, [e.token_ids for e in echoes], params, body.stream, responder,
                              "prompt", prompt_only=body.scores_prompt_only)

    return app


def _prompt_echoes(prompts: list[str | list[int]], body: CompletionRequest, tokenizer: PromptTokenizer,
                   vocab_size: int, max_model_len: int) -> list[PromptEcho]:
    """Each prompt's ids (texts tokenized together), checked and cut to fit, with what echo shows."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(tokenizer.encode_texts(texts, body.add_special_tokens))
    echoes = []
    for prompt in prompts:
        ids = next(encoded) if isinstance(prompt, str) else prompt
        check_token_ids(ids, vocab_size)
        kept = truncate_prompt(ids, body.truncate_prompt_tokens, max_model_len, body.completion_token_limit(),
                               body.truncation_side)
        # Echo shows a text prompt as sent, and token ids (or a cut prompt) as the tokenizer
        # reads them; the decode is skipped when nothing echoes.
        text = prompt if isinstance(prompt, str) and kept is ids else tokenizer.decode(kept) if body.echo else ""
        echoes.append(PromptEcho(text, kept))
    return echoes


def _prompt_tail(body: ChatCompletionRequest, tokenizer: PromptTokenizer) -> str:
    """The end of the prompt the output continues, for the reasoning parser: the template's
    generation prompt (which may open or close a thinking block), or the final message that
    continue_final_message continues. That message's text without think tags is an answer being
    continued (templates strip the thinking of assistant messages), so it reads as after THINK_END."""
    if body.continue_final_message:
        message = body.messages[-1].text() if body.messages else ""
        tagged = THINK_START in message or THINK_END in message
        return message if tagged or not message.strip() else THINK_END + message
    return tokenizer.generation_prompt(body.template_kwargs()) if body.add_generation_prompt else ""


def speller_for(body: ChatCompletionRequest | CompletionRequest, pipeline: Pipeline) -> TokenRenderer:
    renderer = renderer_of(pipeline)
    return TokenIdLabels(renderer) if body.return_tokens_as_token_ids else renderer


async def _check_batch_fits(pipeline: Pipeline, num_prompts: int, n: int = 1) -> None:
    """Refuses a completions batch of more prompts than the replicas together could ever take at
    once, idle (each prompt is one request of n samples: its seats, then its waiting room; a beam
    search's rounds are admitted with it): all are added at once, so the model workers would refuse
    the rest with RESOURCE_EXHAUSTED, a 429 that no retry could ever get past. A replica that is down
    counts with its last known room (it is expected back); one never heard from leaves it to the workers."""
    if num_prompts <= 1:
        return
    replicas = [r for r in pipeline.model_workers.live if not r.refusal]  # a wrong model's never counts
    rooms = await asyncio.gather(*(r.waiting_room(n) for r in replicas))
    if not rooms or None in rooms:
        return  # unknown: the model workers decide
    capacity = sum(rooms)
    if num_prompts > capacity:
        raise invalid_request(f"this batch of {num_prompts} prompts is more than the model workers queue at once "
                              f"({capacity}); send at most {capacity} per request", param="prompt")


async def _respond(request: Request, pipeline: Pipeline, prompts: Sequence[Sequence[int]], params: GenerationParams,
                   stream: bool, responder: Responder, prompt_param: str, prompt_only: bool = False) -> Response:
    """prompt_only: each choice's one generated token is left out of the answer (echo with
    max_tokens 0: the prompt is what is asked for)."""
    # The scoring token of prompt_only is not the client's: the refusal counts the prompt alone,
    # which refuses at the same length (a full context has no room for that token either).
    max_tokens = None if prompt_only else params.max_tokens
    max_model_len = pipeline.model_info.max_model_len
    for prompt_ids in prompts:
        check_context_length(len(prompt_ids), max_tokens, max_model_len, prompt_param)
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_choices = len(prompts) * params.n
    access = access_record(request.scope)
    timer = RequestTimer(request.app.state.metrics, [len(p) for p in prompts], params.n, access=access)
    if access is not None:
        timer.started = access.started  # latencies count from the request's arrival, as vLLM's do
        responder.use_request_id(access.request_id)
    events = _merge_prompts([pipeline.generate(p, fitted_to(params, len(p), max_model_len)) for p in prompts],
                            params.n)
    if prompt_only:
        events = _without_output(events)  # before the metering: the scoring token is nobody's output
    events = metered(events, timer)
    events = with_deadline(events, request.app.state.limits.request_timeout_s)
    if not stream:
        outputs = await _collect_unless_disconnected(request, events, num_choices)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening any more
        for index, output in enumerate(outputs):
            await responder.prepare(index, output.as_event())
        answer = responder.response(outputs, num_prompt_tokens).model_dump()
        if responder.return_token_ids:
            responder.add_token_ids(answer, outputs)
        return JSONResponse(answer)
    # The first event is awaited before the headers go out, so a refusal by the model worker
    # (429, 400) still gets its own HTTP status instead of an error event in a 200 stream. A
    # client that leaves while its request waits for a seat is noticed here too.
    try:
        waited = await _unless_disconnected(request, anext(events))
        if waited is None:
            await events.aclose()
            return Response(status_code=499)
        first = waited.result()
    except BaseException:
        await events.aclose()
        raise
    choice_prompt_tokens = [len(prompt_ids) for prompt_ids in prompts for _ in range(params.n)]
    return StreamingResponse(sse_stream(first, events, responder, num_prompt_tokens, choice_prompt_tokens),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _without_output(events: ChoiceEvents) -> ChoiceEvents:
    """The events with nothing generated in them: the prompt's logprobs only, no text or tokens,
    no completion tokens in usage, and finish_reason length (as vLLM's echo without generation)."""
    async with aclosing(events):
        async for index, event in events:
            yield index, dataclasses.replace(
                event, text="", token_ids=[], logprobs=[], top_logprobs=[], num_output_tokens=0, stop_reason=None,
                finish_reason=None if event.finish_reason is None else "length")


async def _merge_prompts(prompts: list[AsyncGenerator[tuple[int, GenerationEvent], None]], n: int) -> ChoiceEvents:
    """(choice index, event) pairs of every prompt's n choices in arrival order, choice
    prompt * n + index as OpenAI numbers a batch; closing it aborts them all."""
    if len(prompts) == 1:
        async with aclosing(prompts[0]) as only:
            async for pair in only:
                yield pair
        return
    merged: asyncio.Queue[tuple[int, GenerationEvent] | BaseException | None] = asyncio.Queue()

    async def pump(offset: int, choices: AsyncGenerator[tuple[int, GenerationEvent], None]) -> None:
        try:
            async with aclosing(choices):
                async for index, event in choices:
                    merged.put_nowait((offset + index, event))
            merged.put_nowait(None)
        except Exception as exc:
            merged.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i * n, p)) for i, p in enumerate(prompts)]
    try:
        running = len(tasks)
        while running:
            item = await merged.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # each prompt's generator aborts its request as it unwinds
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (uvicorn sends it
    # when the client goes, or after the response is complete).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """Runs `work` until it ends (its future, done) or the client leaves first (None; `work` is
    cancelled, which aborts the requests of a generator it was reading)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
        # Done: the watcher unwinds on its own. Awaiting it cost two turns of the event loop before
        # the first token's response could start (66 against 30-36 us, stand-in timestamps); a
        # disconnect it saw is seen again, since uvicorn answers every later receive() with it.
    return None if task.cancelled() else task


async def _collect_unless_disconnected(request: Request, events: ChoiceEvents,
                                       num_choices: int) -> list[ChoiceOutput] | None:
    """Every choice's full output, or None when the client left first (its requests are aborted)."""
    outputs = [ChoiceOutput() for _ in range(num_choices)]

    async def collect() -> None:
        async with aclosing(events):
            async for index, event in events:
                outputs[index].add(event)

    collector = await _unless_disconnected(request, collect())
    if collector is None:
        return None
    collector.result()  # raises the choice's APIError
    return outputs
