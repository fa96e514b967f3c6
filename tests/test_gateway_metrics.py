"""Unit tests of the gateway's Prometheus metrics: names, the per-request timer, the access record.

Feeds GenerationEvents through `metered` as the app does, then reads the exposition text.
"""

from __future__ import annotations

import asyncio

from gateway.http_middleware import AccessRecord
from gateway.metrics import GatewayMetrics, RequestTimer, metered
from gateway.request_state import GenerationEvent
from tokenwire.v1 import model_worker_pb2


def sample(text: str, name: str) -> float:
    """The value of one series in Prometheus text, e.g. 'tokenwire:prompt_tokens_total'."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the exposition")


async def events():
    yield 0, GenerationEvent(text="a", token_ids=[1], num_output_tokens=1)
    await asyncio.sleep(0.01)
    yield 1, GenerationEvent(text="bc", token_ids=[2, 3], num_output_tokens=2)
    await asyncio.sleep(0.01)
    yield 0, GenerationEvent(text="d", token_ids=[4], num_output_tokens=2, finish_reason="stop")
    yield 1, GenerationEvent(text="", token_ids=[], num_output_tokens=2, finish_reason="length")


async def test_metered_stream_records_latencies_tokens_and_the_access_record() -> None:
    metrics = GatewayMetrics()
    access = AccessRecord("rid")
    timer = RequestTimer(metrics, num_prompt_tokens=5, num_choices=2, access=access)
    seen = [index async for index, _ in metered(events(), timer)]
    assert seen == [0, 1, 0, 1]
    text = metrics.render().decode()
    assert sample(text, "tokenwire:prompt_tokens_total") == 5
    assert sample(text, "tokenwire:generation_tokens_total") == 4
    assert sample(text, "tokenwire:time_to_first_token_seconds_count") == 1
    # choice 0 has one gap (one token), choice 1's tokens came in one event: no gap of its own
    assert sample(text, "tokenwire:inter_token_latency_seconds_count") == 1
    assert sample(text, "tokenwire:e2e_request_latency_seconds_count") == 1
    assert sample(text, 'tokenwire:request_success_total{finished_reason="stop"}') == 1
    assert sample(text, 'tokenwire:request_success_total{finished_reason="length"}') == 1
    assert access.prompt_tokens == 5 and access.completion_tokens == 4


async def test_a_request_the_model_worker_never_took_counts_no_tokens_and_a_left_one_an_abort() -> None:
    """Refused (400, 429) before any event: no prompt tokens, no latency sample, as vLLM's engine
    counts only what it ran. Cut short after one event (the client left, the time ran out): its
    tokens count, and each unfinished choice is an abort, so the success counter adds up."""
    metrics = GatewayMetrics()

    async def refused():
        raise RuntimeError("queue full")
        yield  # an async generator

    try:
        async for _ in metered(refused(), RequestTimer(metrics, num_prompt_tokens=31, num_choices=1)):
            pass
    except RuntimeError:
        pass
    text = metrics.render().decode()
    assert sample(text, "tokenwire:prompt_tokens_total") == 0
    assert sample(text, "tokenwire:e2e_request_latency_seconds_count") == 0
    stream = metered(events(), RequestTimer(metrics, num_prompt_tokens=5, num_choices=3))
    await anext(stream)
    await stream.aclose()  # the client left after the first token
    text = metrics.render().decode()
    assert sample(text, "tokenwire:prompt_tokens_total") == 5
    assert sample(text, "tokenwire:generation_tokens_total") == 1
    assert sample(text, 'tokenwire:request_success_total{finished_reason="abort"}') == 3


def test_load_gauges_and_error_counters() -> None:
    metrics = GatewayMetrics()
    metrics.set_load("m:1", model_worker_pb2.WorkerLoad(num_running=3, num_waiting=2, kv_blocks_total=10,
                                                        kv_blocks_used=4))
    metrics.model_worker_rpc_errors.labels(worker="m:1", rpc="Generate", code="UNAVAILABLE").inc()
    metrics.detok_rpc_errors.labels(worker="w:1", rpc="Detokenize").inc()
    text = metrics.render().decode()
    assert sample(text, 'tokenwire:num_requests_running{worker="m:1"}') == 3
    assert sample(text, "tokenwire:num_requests_waiting") == 2
    assert sample(text, "tokenwire:kv_cache_usage_perc") == 0.4
    assert sample(text, "tokenwire:model_worker_rpc_errors_total") == 1
    assert sample(text, "tokenwire:detok_rpc_errors_total") == 1
