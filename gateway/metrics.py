"""The gateway's Prometheus metrics, named after vLLM's (`vllm:x` → `tokenwire:x`) where one exists.

app.py makes one GatewayMetrics per app (its own registry), wraps every request's event stream
in `metered` (TTFT, inter-token and end-to-end latency, token counts, per choice as vLLM counts
each sample), refreshes each model worker replica's queue gauges and cache and preemption totals
from GetLoad on each scrape (label `worker`), and the pipeline counts worker RPC errors. Every
series carries vLLM's `model_name` label (the served model name), which vLLM's dashboards select on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from gateway.errors import APIError
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
# The finish reasons request_success counts, each series there from the start as vLLM's are (a
# series' first increment is invisible to rate() and increase()).
FINISHED_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for its per-request token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = ""
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
                                             "Time from request arrival to its choice's last output",
                                             buckets=_E2E_BUCKETS, registry=r)
        self.request_time_per_output_token = Histogram(
            f"{PREFIX}request_time_per_output_token_seconds",
            "A choice's mean time per output token after those of its first output", buckets=_ITL_BUCKETS,
            registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Output tokens generated", registry=r)
        self.request_success = Counter(f"{PREFIX}request_success", "Choices finished, by finish reason",
                                       ["finished_reason"], registry=r)
        for reason in FINISHED_REASONS:
            self.request_success.labels(finished_reason=reason)
        # Their buckets run to the model's context: made by describe_model once it is known.
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.model_worker_rpc_errors = Counter(f"{PREFIX}model_worker_rpc_errors",
                                               "Failed model worker RPCs (Generate, GetLoad), and requests a model "
                                               "worker refused or failed (AddRequest)",
                                               ["worker", "rpc", "code"], registry=r)
        self.detok_rpc_errors = Counter(f"{PREFIX}detok_rpc_errors", "Failed detok worker RPCs",
                                        ["worker", "rpc"], registry=r)
        self.detok_sequences_reopened = Counter(
            f"{PREFIX}detok_sequences_reopened", "Sequences replayed on another detok replica after theirs was lost",
            ["worker"], registry=r)
        # Each model worker replica's last GetLoad: its running prefix cache and preemption totals.
        self._worker_loads: dict[str, model_worker_pb2.WorkerLoad] = {}
        r.register(_WorkerTotals(self._worker_loads))

    def describe_model(self, model_name: str, max_model_len: int) -> None:
        """The served model: its name labels every series, its context bounds the token histograms."""
        self.model_name = model_name
        if self.request_prompt_tokens is None:
            buckets = buckets_1_2_5(max(max_model_len, 1))
            self.request_prompt_tokens = Histogram(f"{PREFIX}request_prompt_tokens", "Prompt tokens of a choice",
                                                   buckets=buckets, registry=self.registry)
            self.request_generation_tokens = Histogram(f"{PREFIX}request_generation_tokens",
                                                       "Output tokens of a choice", buckets=buckets,
                                                       registry=self.registry)

    def clear_replicas(self) -> None:
        """Forgets every per-replica series before a scrape sets them again: a replica that left
        (or stopped answering) shows no stale numbers."""
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                      self.model_worker_sequences, self.model_worker_connected):
            gauge.clear()
        self._worker_loads.clear()

    def set_load(self, worker: str, load: model_worker_pb2.WorkerLoad) -> None:
        self.num_requests_running.labels(worker=worker).set(load.num_running)
        self.num_requests_waiting.labels(worker=worker).set(load.num_waiting)
        if load.kv_blocks_total:
            self.kv_cache_usage_perc.labels(worker=worker).set(load.kv_blocks_used / load.kv_blocks_total)
        self._worker_loads[worker] = load

    def render(self) -> bytes:
        return generate_latest(_WithModelName(self.registry, self.model_name))


# (name, help, WorkerLoad field) of the model workers' running totals.
_WORKER_TOTALS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queried_tokens"),
    ("prefix_cache_hits", "Prompt tokens served from the prefix cache", "prefix_cache_hit_tokens"),
    ("num_preemptions", "Sequences preempted (their KV blocks freed, recomputed later)", "num_preemptions"),
)


class _WorkerTotals:
    """The model workers' own running totals, as counters (a worker that restarts starts again at
    0, which Prometheus reads as a counter reset)."""

    def __init__(self, loads: dict[str, model_worker_pb2.WorkerLoad]) -> None:
        self.loads = loads

    def collect(self) -> list[Metric]:
        families = []
        for name, documentation, field_name in _WORKER_TOTALS:
            family = CounterMetricFamily(f"{PREFIX}{name}", documentation, labels=["worker"])
            for worker, load in self.loads.items():
                family.add_metric([worker], getattr(load, field_name))
            families.append(family)
        return families


class _WithModelName:
    """The registry's series, each with a model_name label, as vLLM labels all of its own."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [sample._replace(labels={"model_name": self.model_name, **sample.labels})
                              for sample in family.samples]
            yield family


@dataclass
class RequestTimer:
    """Latency and token accounting of one HTTP request: per choice (each sample of each prompt),
    as vLLM's engine counts each of its requests, with the prompt tokens once per prompt."""

    metrics: GatewayMetrics | None
    # Each prompt's length; choice i is a sample of prompt i // n, as OpenAI numbers a batch's.
    prompt_lens: Sequence[int]
    n: int = 1
    # The access log line's token counts are filled in when the request ends.
    access: AccessRecord | None = None
    started: float = field(default_factory=time.perf_counter)
    # Per choice: when its first and its latest tokens arrived, the tokens after its first event
    # (inter_token_latency's samples), its output tokens so far, and its end.
    first_token_at: dict[int, float] = field(default_factory=dict)
    last_token_at: dict[int, float] = field(default_factory=dict)
    num_later_tokens: dict[int, int] = field(default_factory=dict)
    num_output_tokens: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    finished_at: dict[int, float] = field(default_factory=dict)
    # The model worker refused it (400, 429) before any output: then nothing counts, as vLLM's
    # engine counts only what it took.
    refused: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_choices(self) -> int:
        return len(self.prompt_lens) * self.n

    @property
    def total_output_tokens(self) -> int:
        return sum(self.num_output_tokens.values())

    def observe(self, index: int, event: GenerationEvent) -> None:
        now = time.perf_counter()
        m = self.metrics
        if event.token_ids:
            previous = self.last_token_at.get(index)
            if previous is None:
                self.first_token_at[index] = now
                self.num_later_tokens[index] = 0
                if m is not None:
                    m.time_to_first_token.observe(now - self.started)
            else:
                self.num_later_tokens[index] += len(event.token_ids)
                if m is not None:
                    # Tokens that came together share the gap since the previous ones.
                    gap = (now - previous) / len(event.token_ids)
                    for _ in event.token_ids:
                        m.inter_token_latency.observe(gap)
            self.last_token_at[index] = now
        self.num_output_tokens[index] = event.num_output_tokens
        if event.finish_reason is not None:
            self.finish_reasons[index] = event.finish_reason
            self.finished_at[index] = now

    def finish(self) -> None:
        if self.access is not None:
            self.access.prompt_tokens = self.num_prompt_tokens
            self.access.completion_tokens = self.total_output_tokens
        m = self.metrics
        if m is None or self.refused:
            return
        now = time.perf_counter()
        # The prompts some output came for were run (a batch's prompts still queued when it ended, not).
        ran = {index // self.n for index in self.num_output_tokens}
        m.prompt_tokens.inc(sum(length for prompt, length in enumerate(self.prompt_lens) if prompt in ran))
        m.generation_tokens.inc(self.total_output_tokens)
        for index in sorted(set(range(self.num_choices)) | self.finish_reasons.keys()):
            # A choice that never finished (its client left, its time ran out, it failed) is an
            # abort, vLLM's label for it: the counters then add up to the choices that ran.
            m.request_success.labels(finished_reason=self.finish_reasons.get(index, "abort")).inc()
            m.e2e_request_latency.observe(self.finished_at.get(index, now) - self.started)
            if self.num_later_tokens.get(index):  # the mean of its inter_token_latency samples
                decode_s = self.last_token_at[index] - self.first_token_at[index]
                m.request_time_per_output_token.observe(decode_s / self.num_later_tokens[index])
            num_output_tokens = self.num_output_tokens.get(index, 0)
            if m.request_prompt_tokens is not None and m.request_generation_tokens is not None:
                m.request_prompt_tokens.observe(self.prompt_lens[min(index // self.n, len(self.prompt_lens) - 1)])
                m.request_generation_tokens.observe(num_output_tokens)


EventStream = AsyncGenerator[tuple[int, GenerationEvent], None]


async def metered(events: EventStream, timer: RequestTimer) -> EventStream:
    """The same (index, event) pairs, timed; closing it closes (and so aborts) the inner stream.
    A request that ends before any output counts (as aborted choices) unless the model worker
    refused it: a client that left it waiting in the queue, or whose time ran out there, shows."""
    try:
        async with aclosing(events):
            async for index, event in events:
                timer.observe(index, event)
                yield index, event
    except APIError as exc:
        timer.refused = not timer.num_output_tokens and exc.status < 500  # no event came before it
        raise
    finally:
        timer.finish()
