"""Size and time limits on one API request, so one client cannot tie up the stack.

Pydantic checks the shape of a body; these check its size against the operator's limits
(gateway Config), each with a 400 that names the parameter and the limit. The body-size limit
is enforced in GatewayHTTPMiddleware before the body is parsed, and the time limit wraps the
request's event stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.errors import APIError, invalid_request

T = TypeVar("T")


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 8 << 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512
    max_logit_bias_entries: int = 1024
    max_bad_words: int = 256
    max_token_id_list: int = 8192  # allowed_token_ids, stop_token_ids
    request_timeout_s: float = 600.0  # 0: none


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large", error_type="invalid_request_error")


def check_request_limits(body: Any, limits: RequestLimits) -> None:
    """Raises a 400 APIError for the first field over its limit."""
    stops = body.stop_strings()
    if len(stops) > limits.max_stop_strings:
        raise invalid_request(f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}",
                              "stop")
    for stop in stops:
        if len(stop) > limits.max_stop_string_chars:
            raise invalid_request(f"stop strings may be at most {limits.max_stop_string_chars} characters, got one "
                                  f"of {len(stop)}", "stop")
    sized = (("logit_bias", limits.max_logit_bias_entries), ("bad_words", limits.max_bad_words),
             ("allowed_token_ids", limits.max_token_id_list), ("stop_token_ids", limits.max_token_id_list))
    for name, limit in sized:
        value = getattr(body, name, None)
        if value is not None and len(value) > limit:
            raise invalid_request(f"{name} may have at most {limit} entries, got {len(value)}", name)


async def with_deadline(events: AsyncGenerator[T, None], timeout_s: float) -> AsyncGenerator[T, None]:
    """The same events until timeout_s after the call; then the inner stream is closed (which
    aborts the request at the model worker) and a 504 APIError says why.

    One timer for the whole request, where an asyncio.timeout around each event costs a timer
    scheduled and cancelled per token (4 us of the gateway's ~100 us a token at 32 streams,
    measured). Like asyncio.timeout, the timer cancels the task while it waits for the next
    event. Past the deadline between events (the consumer busy, or blocked sending to a client
    that reads slowly), the timer closes the inner stream itself, so the request stops at the
    model worker then, not once the client has read what was sent (a slowly read stream ran 10 s
    past a 20 s timeout: review 106), and the next wait is not started."""
    if timeout_s <= 0:
        async with aclosing(events):
            async for event in events:
                yield event
        return
    loop = asyncio.get_running_loop()
    waiting: asyncio.Task | None = None  # the task awaiting the next event, if one is
    cancelled: asyncio.Task | None = None  # the task the timer cancelled, until that is taken back
    closing: asyncio.Task | None = None  # the timer's close of the inner stream, when nobody waited on it
    expired = False

    def expire() -> None:
        nonlocal expired, cancelled, closing
        expired = True
        if waiting is not None:
            waiting.cancel()
            cancelled = waiting
        else:  # suspended between events: the inner stream is not running, so it can be closed now
            closing = loop.create_task(events.aclose())

    def timed_out() -> APIError:
        return APIError(504, f"the request did not finish within this server's request timeout of {timeout_s:g} s",
                        code="request_timeout", error_type="timeout_error")

    timer = loop.call_at(loop.time() + timeout_s, expire)
    try:
        while True:
            if expired:
                raise timed_out()
            # The consumer's task can change (the route awaits the first event, Starlette's
            # response task the rest), so it is taken at every wait.
            waiting = asyncio.current_task()
            try:
                event = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                # Ours only when the timer cancelled the task and nobody else also did.
                if cancelled is not None:
                    others = cancelled.uncancel()
                    cancelled = None
                    if others == 0:
                        raise timed_out() from None
                raise
            finally:
                waiting = None
            yield event
    finally:
        timer.cancel()
        if cancelled is not None:  # the inner stream swallowed the timer's cancel: take it back
            cancelled.uncancel()
        # The inner stream closes once (aclosing's close would meet the timer's still running).
        await (closing if closing is not None else events.aclose())
