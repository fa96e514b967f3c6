"""Request size and time limits: body bytes (413), stop strings / logit_bias / token lists (400),
and the request timeout (504, aborting the inner stream)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from gateway.errors import APIError
from gateway.http_middleware import GatewayHTTPMiddleware
from gateway.openai_requests import CompletionRequest
from gateway.request_limits import RequestLimits, check_request_limits, with_deadline

LIMITS = RequestLimits(max_body_bytes=1000, max_stop_strings=2, max_stop_string_chars=5, max_logit_bias_entries=3,
                       max_bad_words=2, max_token_id_list=4, request_timeout_s=1.0)


def completion(**kw) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="hi", **kw)


@pytest.mark.parametrize("kw, param", [
    ({"stop": ["a", "b", "c"]}, "stop"),
    ({"stop": "abcdef"}, "stop"),
    ({"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias"),
    ({"bad_words": ["x", "y", "z"]}, "bad_words"),
    ({"allowed_token_ids": [1, 2, 3, 4, 5]}, "allowed_token_ids"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
])
def test_fields_over_their_limit_are_400_naming_the_param(kw, param):
    with pytest.raises(APIError) as info:
        check_request_limits(completion(**kw), LIMITS)
    assert info.value.status == 400 and info.value.param == param and "at most" in info.value.message


def test_fields_at_their_limit_pass():
    check_request_limits(completion(stop=["a", "abcde"], logit_bias={"1": 1, "2": 1, "3": 1}, bad_words=["x", "y"],
                                    allowed_token_ids=[1, 2, 3, 4], stop_token_ids=[1, 2, 3, 4]), LIMITS)


def echo_app() -> GatewayHTTPMiddleware:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    return GatewayHTTPMiddleware(app, max_body_bytes=LIMITS.max_body_bytes)


async def post(body: bytes, chunked: bool = False) -> httpx.Response:
    async def chunks():
        for i in range(0, len(body), 100):
            yield body[i:i + 100]

    transport = httpx.ASGITransport(app=echo_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post("/v1/echo", content=chunks() if chunked else body)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_is_413_in_openai_shape_and_at_the_limit_passes(chunked):
    big = asyncio.run(post(b"x" * 1001, chunked))
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large" and "1000 bytes" in big.json()["error"]["message"]
    ok = asyncio.run(post(b"x" * 1000, chunked))
    assert ok.status_code == 200 and ok.json() == {"size": 1000}


def test_deadline_ends_a_slow_stream_with_504_and_closes_it():
    closed = asyncio.Event()

    async def slow():
        try:
            yield 1
            await asyncio.sleep(10)
            yield 2
        finally:
            closed.set()

    async def run() -> tuple[list[int], APIError]:
        got = []
        with pytest.raises(APIError) as info:
            async for event in with_deadline(slow(), 0.2):
                got.append(event)
        return got, info.value

    got, error = asyncio.run(run())
    assert closed.is_set()  # the inner stream was closed, which is what aborts it at the worker
    assert got == [1] and error.status == 504 and error.code == "request_timeout" and "0.2 s" in error.message


def test_deadline_between_events_ends_the_stream_at_the_next_wait():
    async def quick():
        for i in range(3):
            yield i

    async def run() -> tuple[list[int], APIError]:
        got = []
        with pytest.raises(APIError) as info:
            async for event in with_deadline(quick(), 0.05):
                got.append(event)
                await asyncio.sleep(0.1)  # a slow consumer: the deadline passes while it works
        return got, info.value

    got, error = asyncio.run(run())
    assert got == [0] and error.status == 504


def test_deadline_while_the_consumer_is_blocked_closes_the_inner_stream_at_once():
    """The consumer blocked between events (sending to a client that reads slowly): the request
    stopped at the model worker only once the client had read on, 10 s past a 20 s timeout
    (review 106). Now the timer closes the inner stream itself, and the next wait is the 504."""
    closed_at: list[float] = []

    async def endless():
        try:
            while True:
                yield 1
                await asyncio.sleep(0.01)
        finally:
            closed_at.append(asyncio.get_running_loop().time())

    async def run() -> tuple[float, float, APIError]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        events = with_deadline(endless(), 0.05)
        assert await anext(events) == 1
        await asyncio.sleep(0.3)  # blocked in send, past the deadline
        resumed = loop.time()
        with pytest.raises(APIError) as info:
            await anext(events)
        await events.aclose()
        return started, resumed, info.value

    started, resumed, error = asyncio.run(run())
    assert error.status == 504
    assert len(closed_at) == 1 and closed_at[0] - started < 0.2 and closed_at[0] < resumed


def test_deadline_while_blocked_then_the_client_leaves_closes_the_inner_stream_once():
    closes = 0

    async def endless():
        nonlocal closes
        try:
            while True:
                yield 1
                await asyncio.sleep(0.01)
        finally:
            await asyncio.sleep(0.02)  # an abort that takes a moment: the consumer's close comes meanwhile
            closes += 1

    async def run() -> None:
        events = with_deadline(endless(), 0.05)
        assert await anext(events) == 1
        await asyncio.sleep(0.06)  # the timer's close is under way
        await events.aclose()  # the client left

    asyncio.run(run())
    assert closes == 1


def test_deadline_follows_the_consumer_to_another_task():
    """The route awaits the first event in its task, Starlette's response task the rest."""
    async def slow():
        yield 1
        await asyncio.sleep(30)
        yield 2

    async def run() -> tuple[APIError, float]:
        started = asyncio.get_running_loop().time()
        events = with_deadline(slow(), 0.2)

        async def first() -> int:
            return await anext(events)

        # The first event in a task that has ended by the time the deadline passes: a timer
        # that cancelled that task instead of the one now waiting would never end the stream.
        assert await asyncio.create_task(first()) == 1
        with pytest.raises(APIError) as info:
            async with asyncio.timeout(3):  # well before slow() would go on by itself
                async for _ in events:
                    pass
        return info.value, asyncio.get_running_loop().time() - started

    error, elapsed = asyncio.run(run())
    assert error.status == 504 and elapsed < 1.5  # at the deadline, not at the outer timeout


def test_a_cancellation_that_is_not_the_deadline_stays_a_cancellation():
    async def slow():
        yield 1
        await asyncio.sleep(10)
        yield 2

    async def run() -> None:
        async def consume() -> None:
            async for _ in with_deadline(slow(), 5.0):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_cancel_the_inner_stream_swallows_is_taken_back():
    async def stubborn():
        yield 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # swallowed: the stream goes on
        yield 2

    async def run() -> tuple[list[int], int]:
        got = []
        with pytest.raises(APIError):
            async for event in with_deadline(stubborn(), 0.1):
                got.append(event)
        return got, asyncio.current_task().cancelling()

    got, cancelling = asyncio.run(run())
    assert got == [1, 2] and cancelling == 0  # no cancel left pending on the task


def test_no_deadline_passes_everything_through():
    async def quick():
        for i in range(3):
            yield i

    async def run() -> list[int]:
        return [e async for e in with_deadline(quick(), 0)]

    assert asyncio.run(run()) == [0, 1, 2]


def test_access_log_has_latency_and_request_id_but_no_body_text(caplog: pytest.LogCaptureFixture):
    marker = "zanzibar-quokka-7731"

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=echo_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post("/v1/echo", json={"prompt": marker}, headers={"X-Request-Id": "log-check-1"})

    with caplog.at_level("INFO", logger="gateway.access"):
        reply = asyncio.run(run())
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "log-check-1"
    lines = [r.getMessage() for r in caplog.records]
    assert any("log-check-1" in line and "ms" in line for line in lines)
    assert not any(marker in line for line in lines)
