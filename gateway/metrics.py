"""The gateway's Prometheus metrics, named after vLLM's (`vllm:x` → `tokenwire:x`) where one exists.

app.py makes one GatewayMetrics per app (its own registry), wraps every request's event stream
in `metered` (TTFT, inter-token and end-to-end latency, token counts), refreshes each model worker
replica's queue gauges from GetLoad on each scrape (label `worker`), and the pipeline counts worker
RPC errors.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.http_middleware import AccessRecord
from gateway.request_state import GenerationEvent
from tokenwire.v1 import model_worker_pb2

PREFIX = "tokenwire:"
# vLLM's buckets, so dashboards built for vLLM read ours the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # GetLoad counts sequences: each sample of n > 1 and each beam search round, as vLLM v1
        # counts its child requests under the same names.
        self.num_requests_running = Gauge(f"{PREFIX}num_requests_running",
                                          "Sequences the model worker is running (GetLoad)", ["worker"], registry=r)
        self.num_requests_waiting = Gauge(f"{PREFIX}num_requests_waiting",
                                          "Sequences waiting in the model worker's queue: new, preempted, beam "
                                          "search rounds (GetLoad)", ["worker"], registry=r)
        self.kv_cache_usage_perc = Gauge(f"{PREFIX}kv_cache_usage_perc",
                                         "Fraction of KV cache blocks in use, 0..1 (GetLoad)", ["worker"], registry=r)
        self.model_worker_sequences = Gauge(f"{PREFIX}gateway_model_worker_sequences",
                                            "Sequences the gateway has placed on each model worker replica",
                                            ["worker"], registry=r)
        self.model_worker_connected = Gauge(f"{PREFIX}gateway_model_worker_connected",
                                            "1 while the model worker replica takes new requests, else 0",
                                            ["worker"], registry=r)
        self.num_requests_live = Gauge(f"{PREFIX}gateway_num_requests_live",
                                       "Generation requests the gateway has in flight to the workers (a prompt each: a completions "
                                       "batch of k prompts counts k, as the model workers' AddRequests do)", registry=r)
        self.time_to_first_token = Histogram(f"{PREFIX}time_to_first_token_seconds",
                                             "Time from request arrival to its first output token",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(f"{PREFIX}inter_token_latency_seconds",
                                             "Time between output tokens of one choice", buckets=_ITL_BUCKETS,
                                             registry=r)
        self.e2e_request_latency = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                                             "Time from request arrival to its last output",
                                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Output tokens generated", registry=r)
        self.request_success = Counter(f"{PREFIX}request_success", "Choices finished, by finish reason",
                                       ["finished_reason"], registry=r)
        self.model_worker_rpc_errors = Counter(f"{PREFIX}model_worker_rpc_errors",
                                               "Failed model worker RPCs and per-request refusals",
                                               ["worker", "rpc", "code"], registry=r)
        self.detok_rpc_errors = Counter(f"{PREFIX}detok_rpc_errors", "Failed detok worker RPCs",
                                        ["worker", "rpc"], registry=r)
        self.detok_sequences_reopened = Counter(
            f"{PREFIX}detok_sequences_reopened", "Sequences replayed on another detok replica after theirs was lost",
            ["worker"], registry=r)

    def clear_replicas(self) -> None:
        """Forgets every per-replica series before a scrape sets them again: a replica that left
        (or stopped answering) shows no stale numbers."""
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                      self.model_worker_sequences, self.model_worker_connected):
            gauge.clear()

    def set_load(self, worker: str, load: model_worker_pb2.WorkerLoad) -> None:
        self.num_requests_running.labels(worker=worker).set(load.num_running)
        self.num_requests_waiting.labels(worker=worker).set(load.num_waiting)
        if load.kv_blocks_total:
            self.kv_cache_usage_perc.labels(worker=worker).set(load.kv_blocks_used / load.kv_blocks_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RequestTimer:
    """Latency and token accounting of one HTTP request (all its choices)."""

    metrics: GatewayMetrics | None
    num_prompt_tokens: int
    num_choices: int = 1
    # The access log line's token counts are filled in when the request ends.
    access: AccessRecord | None = None
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # Per choice: when its previous tokens arrived, and its output tokens so far.
    last_token_at: dict[int, float] = field(default_factory=dict)
    num_output_tokens: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    # The model worker sent something (took the request): only then do its prompt tokens and
    # its latency count, as vLLM's engine counts only what it ran (a refusal, 400 or 429, not).
    answered: bool = False

    @property
    def total_output_tokens(self) -> int:
        return sum(self.num_output_tokens.values())

    def observe(self, index: int, event: GenerationEvent) -> None:
        now = time.perf_counter()
        m = self.metrics
        self.answered = True
        if event.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                if m is not None:
                    m.time_to_first_token.observe(now - self.started)
            previous = self.last_token_at.get(index)
            if previous is not None and m is not None:
                # Tokens that came together share the gap since the previous ones.
                gap = (now - previous) / len(event.token_ids)
                for _ in event.token_ids:
                    m.inter_token_latency.observe(gap)
            self.last_token_at[index] = now
        self.num_output_tokens[index] = event.num_output_tokens
        if event.finish_reason is not None:
            self.finish_reasons[index] = event.finish_reason

    def finish(self) -> None:
        if self.access is not None:
            self.access.prompt_tokens = self.num_prompt_tokens
            self.access.completion_tokens = self.total_output_tokens
        m = self.metrics
        if m is None or not self.answered:
            return
        m.e2e_request_latency.observe(time.perf_counter() - self.started)
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.generation_tokens.inc(self.total_output_tokens)
        for index in sorted(set(range(self.num_choices)) | self.finish_reasons.keys()):
            # A choice that never finished (its client left, its time ran out, it failed) is an
            # abort, vLLM's label for it: the counters then add up to the requests that ran.
            m.request_success.labels(finished_reason=self.finish_reasons.get(index, "abort")).inc()


EventStream = AsyncGenerator[tuple[int, GenerationEvent], None]


async def metered(events: EventStream, timer: RequestTimer) -> EventStream:
    """The same (index, event) pairs, timed; closing it closes (and so aborts) the inner stream."""
    try:
        async with aclosing(events):
            async for index, event in events:
                timer.observe(index, event)
                yield index, event
    finally:
        timer.finish()
