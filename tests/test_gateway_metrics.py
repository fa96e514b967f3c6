"""Unit tests of the gateway's Prometheus metrics: names, the per-request timer, the access record.

Feeds GenerationEvents through `metered` as the app does, then reads the exposition text.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import APIError
from gateway.http_middleware import AccessRecord
from gateway.metrics import GatewayMetrics, RequestTimer, metered
from gateway.request_state import GenerationEvent
from tokenwire.v1 import model_worker_pb2


def series(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus exposition, by (name, its labels but model_name)."""
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the first series named `name` (e.g. 'tokenwire:prompt_tokens_total') whose
    labels include `labels`."""
    for (series_name, series_labels), value in series(text).items():
        if series_name == name and set(labels.items()) <= series_labels:
            return value
    raise AssertionError(f"{name} {labels} not in the exposition")


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
    timer = RequestTimer(metrics, prompt_lens=[5], n=2, access=access)
    seen = [index async for index, _ in metered(events(), timer)]
    assert seen == [0, 1, 0, 1]
    text = metrics.render().decode()
    assert sample(text, "tokenwire:prompt_tokens_total") == 5
    assert sample(text, "tokenwire:generation_tokens_total") == 4
    # Per choice, as vLLM's engine counts each sample: two first tokens, two ends.
    assert sample(text, "tokenwire:time_to_first_token_seconds_count") == 2
    # choice 0 has one gap (one token), choice 1's tokens came in one event: no gap of its own
    assert sample(text, "tokenwire:inter_token_latency_seconds_count") == 1
    assert sample(text, "tokenwire:request_time_per_output_token_seconds_count") == 1
    assert sample(text, "tokenwire:request_time_per_output_token_seconds_sum") == pytest.approx(
        sample(text, "tokenwire:inter_token_latency_seconds_sum"))
    assert sample(text, "tokenwire:e2e_request_latency_seconds_count") == 2
    # choice 1 ended (an event of its own) after choice 0: its e2e is the longer
    assert sample(text, "tokenwire:e2e_request_latency_seconds_sum") > 2 * 0.02
    assert sample(text, "tokenwire:request_success_total", finished_reason="stop") == 1
    assert sample(text, "tokenwire:request_success_total", finished_reason="length") == 1
    assert access.prompt_tokens == 5 and access.completion_tokens == 4


async def test_a_request_the_model_worker_never_took_counts_no_tokens_and_a_left_one_an_abort() -> None:
    """Refused (400, 429) before any event: no prompt tokens, no latency sample, as vLLM's engine
    counts only what it ran. Cut short after one event (the client left, the time ran out): its
    tokens count, and each unfinished choice is an abort, so the success counter adds up."""
    metrics = GatewayMetrics()

    async def refused():
        raise APIError(429, "queue full")
        yield  # an async generator

    with pytest.raises(APIError):
        async for _ in metered(refused(), RequestTimer(metrics, prompt_lens=[31])):
            pass
    text = metrics.render().decode()
    assert sample(text, "tokenwire:prompt_tokens_total") == 0
    assert sample(text, "tokenwire:e2e_request_latency_seconds_count") == 0
    stream = metered(events(), RequestTimer(metrics, prompt_lens=[5], n=3))
    await anext(stream)
    await stream.aclose()  # the client left after the first token
    text = metrics.render().decode()
    assert sample(text, "tokenwire:prompt_tokens_total") == 5
    assert sample(text, "tokenwire:generation_tokens_total") == 1
    assert sample(text, "tokenwire:request_success_total", finished_reason="abort") == 3


async def test_a_request_that_ends_before_any_output_counts_unless_the_model_worker_refused_it() -> None:
    """A client that left while its request waited in the model worker's queue (or whose time ran
    out there), or a replica lost under it: its choices are aborts with their latency, though no
    prompt tokens ran. A refusal (4xx) counts nothing."""
    metrics = GatewayMetrics()

    async def waiting():
        await asyncio.sleep(10)
        yield 0, GenerationEvent(text="a", token_ids=[1], num_output_tokens=1)

    async def failing(status: int):
        raise APIError(status, "no")
        yield  # an async generator

    stream = metered(waiting(), RequestTimer(metrics, prompt_lens=[7, 9], n=1))
    pending = asyncio.create_task(anext(stream))
    await asyncio.sleep(0.01)
    pending.cancel()  # the client left (the non-stream path cancels its collector)
    with pytest.raises(asyncio.CancelledError):
        await pending
    text = metrics.render().decode()
    assert sample(text, "tokenwire:request_success_total", finished_reason="abort") == 2
    assert sample(text, "tokenwire:e2e_request_latency_seconds_count") == 2
    assert sample(text, "tokenwire:prompt_tokens_total") == 0
    # A batch whose first prompt had output and whose second was still queued: only the first ran (review 105).
    stream = metered(events(), RequestTimer(metrics, prompt_lens=[5, 700], n=2))
    await anext(stream)  # choice 0, of prompt 0
    await stream.aclose()
    assert sample(metrics.render().decode(), "tokenwire:prompt_tokens_total") == 5
    aborts = sample(metrics.render().decode(), "tokenwire:request_success_total", finished_reason="abort")
    assert aborts == 6  # the 2 choices before, and these 4
    for status, aborts in ((429, 6), (400, 6), (503, 7)):
        with pytest.raises(APIError):
            await anext(metered(failing(status), RequestTimer(metrics, prompt_lens=[3])))
        assert sample(metrics.render().decode(), "tokenwire:request_success_total", finished_reason="abort") == aborts


def test_every_series_names_the_model_and_the_finish_reasons_start_at_zero() -> None:
    metrics = GatewayMetrics()
    metrics.describe_model("smol", max_model_len=2048)
    metrics.set_load("m:1", model_worker_pb2.WorkerLoad(num_running=1))
    families = list(text_string_to_metric_families(metrics.render().decode()))
    samples = [s for family in families for s in family.samples]
    assert len(samples) > 50 and all(s.labels.get("model_name") == "smol" for s in samples)
    text = metrics.render().decode()
    for reason in ("stop", "length", "abort"):
        assert sample(text, "tokenwire:request_success_total", finished_reason=reason) == 0
    # vLLM's 1-2-5 buckets up to the context, for each choice's prompt and output tokens
    buckets = [s.labels["le"] for s in samples if s.name == "tokenwire:request_prompt_tokens_bucket"]
    assert buckets[:4] == ["1.0", "2.0", "5.0", "10.0"] and buckets[-2:] == ["2000.0", "+Inf"]


async def test_per_choice_token_histograms() -> None:
    metrics = GatewayMetrics()
    metrics.describe_model("smol", max_model_len=100)
    timer = RequestTimer(metrics, prompt_lens=[5, 40], n=1)
    async for _ in metered(events(), timer):
        pass
    text = metrics.render().decode()
    assert sample(text, "tokenwire:request_prompt_tokens_count") == 2
    assert sample(text, "tokenwire:request_prompt_tokens_sum") == 45
    assert sample(text, "tokenwire:request_prompt_tokens_bucket", le="5.0") == 1
    assert sample(text, "tokenwire:request_generation_tokens_sum") == 4


def test_load_gauges_and_error_counters() -> None:
    metrics = GatewayMetrics()
    metrics.set_load("m:1", model_worker_pb2.WorkerLoad(num_running=3, num_waiting=2, kv_blocks_total=10,
                                                        kv_blocks_used=4))
    metrics.model_worker_rpc_errors.labels(worker="m:1", rpc="Generate", code="UNAVAILABLE").inc()
    metrics.detok_rpc_errors.labels(worker="w:1", rpc="Detokenize").inc()
    text = metrics.render().decode()
    assert sample(text, "tokenwire:num_requests_running", worker="m:1") == 3
    assert sample(text, "tokenwire:num_requests_waiting") == 2
    assert sample(text, "tokenwire:kv_cache_usage_perc") == 0.4
    assert sample(text, "tokenwire:model_worker_rpc_errors_total") == 1
    assert sample(text, "tokenwire:detok_rpc_errors_total") == 1


def test_the_model_workers_prefix_cache_and_preemption_totals_are_counters_per_replica() -> None:
    metrics = GatewayMetrics()
    metrics.set_load("m:1", model_worker_pb2.WorkerLoad(prefix_cache_queried_tokens=100, prefix_cache_hit_tokens=64,
                                                        num_preemptions=3))
    metrics.set_load("m:2", model_worker_pb2.WorkerLoad(prefix_cache_queried_tokens=10))
    text = metrics.render().decode()
    assert sample(text, "tokenwire:prefix_cache_queries_total", worker="m:1") == 100
    assert sample(text, "tokenwire:prefix_cache_hits_total", worker="m:1") == 64
    assert sample(text, "tokenwire:num_preemptions_total", worker="m:1") == 3
    assert sample(text, "tokenwire:prefix_cache_queries_total", worker="m:2") == 10
    assert "# TYPE tokenwire:prefix_cache_hits_total counter" in text
    metrics.clear_replicas()  # a replica that left shows nothing stale
    assert ("tokenwire:prefix_cache_queries_total", frozenset({("worker", "m:1")})) not in series(
        metrics.render().decode())
