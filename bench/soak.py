"""Loopback soak of the whole stack: many concurrent SSE streams, seeded requests of mixed lengths,
a fraction of clients that hang up mid-stream, then a replay of every completed request.

Checks what the reliability issue asks: every completed response is complete and identical to
its seeded replay, no request is lost or duplicated, the model worker's KV blocks return to zero
(GetLoad, when the worker implements it), and each service's RSS stays flat within 10% (peak
of the replay pass vs peak of the soak pass, both after a warm-up pass of the same size). Run: .venv/bin/python bench/soak.py --tiny --streams 64 --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# Run as a script, bench/__init__ does not run first: tokenwire's choice of gRPC socket layer has to
# come before grpc is imported (tokenwire/grpc_io.py).
import tokenwire  # noqa: E402, F401, I001

import grpc  # noqa: E402
import httpx  # noqa: E402

from tokenwire.grpc_server import CHANNEL_OPTIONS  # noqa: E402
from tokenwire.stack import Stack, start_stack  # noqa: E402
from tokenwire.v1 import model_worker_pb2, model_worker_pb2_grpc  # noqa: E402

RSS_GROWTH_LIMIT = 0.10


@dataclass(frozen=True)
class SoakRequest:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float  # 0: greedy; otherwise sampled with `seed`, so a replay draws the same
    seed: int
    # Close the connection after this many content chunks (a client that went away); None: read to the end.
    disconnect_after_chunks: int | None

    def body(self, model: str) -> dict:
        return {"model": model, "prompt": self.prompt_token_ids, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed, "stream": True,
                "stream_options": {"include_usage": True}}


@dataclass
class StreamResult:
    """What one SSE stream delivered, as the client saw it."""

    status: int = 0
    response_ids: set[str] = field(default_factory=set)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the choices' token_ids (return_token_ids)
    num_finish_chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: dict | None = None
    num_done: int = 0  # "data: [DONE]" lines seen
    disconnected: bool = False  # the client hung up on purpose
    started_at: float = 0.0
    first_chunk_at: float | None = None
    ended_at: float = 0.0

    @property
    def complete(self) -> bool:
        return (self.status == 200 and self.error is None and self.num_done == 1 and self.num_finish_chunks == 1
                and len(self.response_ids) == 1 and self.completion_tokens is not None)


def log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    """Mixed lengths: as many short as long requests on a log scale."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def plan_requests(num_requests: int, seed: int, vocab_size: int, max_prompt_tokens: int,
                  max_output_tokens: int, disconnect_fraction: float) -> list[SoakRequest]:
    """The whole soak from one seed: prompts, lengths, sampling and who hangs up."""
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        prompt_len = log_uniform_int(rng, 1, max_prompt_tokens)
        disconnect = rng.random() < disconnect_fraction
        requests.append(SoakRequest(
            index=index,
            prompt_token_ids=[rng.randrange(vocab_size) for _ in range(prompt_len)],
            max_tokens=log_uniform_int(rng, 1, max_output_tokens),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            seed=rng.randrange(2**31),
            disconnect_after_chunks=rng.randint(1, 4) if disconnect else None,
        ))
    return requests


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict,
                            disconnect_after_chunks: int | None = None,
                            first_chunk: asyncio.Event | None = None) -> StreamResult:
    """POSTs a streaming /v1/completions body and reads its SSE events (or hangs up early);
    sets first_chunk once output arrives (or the stream ends without any)."""
    try:
        return await _read_stream(client, url, body, disconnect_after_chunks, first_chunk)
    finally:
        if first_chunk is not None:
            first_chunk.set()


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict, disconnect_after_chunks: int | None,
                       first_chunk: asyncio.Event | None) -> StreamResult:
    result = StreamResult(started_at=time.monotonic())
    num_content_chunks = 0
    async with client.stream("POST", url, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            result.error = response.json().get("error", {"message": response.text})
            result.ended_at = time.monotonic()
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                result.num_done += 1
                continue
            event = json.loads(payload)
            if "error" in event:
                result.error = event["error"]
                continue
            result.response_ids.add(event["id"])
            if event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if result.first_chunk_at is None:
                    result.first_chunk_at = time.monotonic()
                    if first_chunk is not None:
                        first_chunk.set()
                result.text += choice.get("text") or ""
                result.token_ids += choice.get("token_ids") or []
                if choice.get("finish_reason"):
                    result.num_finish_chunks += 1
                    result.finish_reason = choice["finish_reason"]
                num_content_chunks += 1
            if disconnect_after_chunks is not None and num_content_chunks >= disconnect_after_chunks:
                result.disconnected = True
                break  # leaving the block closes the connection mid-stream
    result.ended_at = time.monotonic()
    return result


async def run_pass(base_url: str, model: str, requests: Sequence[SoakRequest], concurrency: int,
                   with_disconnects: bool, timeout_s: float = 600.0) -> dict[int, StreamResult]:
    """Every request once, at most `concurrency` streams open at a time."""
    # A fresh connection per request: reusing a kept-alive one races the server closing it
    # (uvicorn's 5 s keep-alive), and that ReadError would read as a request the stack lost.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    results: dict[int, StreamResult] = {}
    queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)

    async def stream_worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            request = queue.get_nowait()
            if request.index in results:
                raise AssertionError(f"request {request.index} sent twice")
            try:
                results[request.index] = await stream_completion(
                    client, f"{base_url}/v1/completions", request.body(model),
                    request.disconnect_after_chunks if with_disconnects else None)
            except httpx.HTTPError as exc:
                results[request.index] = StreamResult(error={"message": f"{type(exc).__name__}: {exc}"})

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(stream_worker(client) for _ in range(concurrency)))
    return results


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stack_rss(stack: Stack) -> dict[str, int]:
    names: dict[str, int] = {}
    for service in stack.services:
        name = service.name
        if name in names:
            name = f"{name}#{sum(1 for n in names if n.startswith(service.name))}"
        names[name] = rss_bytes(service.process.pid)
    return names


def worker_load(address: str) -> model_worker_pb2.WorkerLoad | None:
    """The model worker's GetLoad, or None while the worker does not implement it."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        try:
            return model_worker_pb2_grpc.ModelWorkerStub(channel).GetLoad(model_worker_pb2.GetLoadRequest(),
                                                                         timeout=5)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise


def wait_idle_load(address: str, timeout_s: float = 10.0) -> model_worker_pb2.WorkerLoad | None:
    """Polls GetLoad until nothing runs, waits or holds a KV block (or timeout_s passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = worker_load(address)
        if load is None or (load.num_running == 0 and load.num_waiting == 0 and load.kv_blocks_used == 0):
            return load
        if time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def compare_with_replay(first: dict[int, StreamResult], replay: dict[int, StreamResult]) -> list[str]:
    """Mismatches between each completed request and its seeded replay."""
    problems = []
    for index, result in sorted(first.items()):
        if result.disconnected:
            continue
        again = replay.get(index)
        if again is None or not again.complete:
            problems.append(f"request {index}: replay incomplete ({again and again.error})")
        elif (result.text, result.finish_reason, result.completion_tokens) != \
                (again.text, again.finish_reason, again.completion_tokens):
            problems.append(f"request {index}: differs from its replay "
                            f"({result.finish_reason}/{result.completion_tokens} vs "
                            f"{again.finish_reason}/{again.completion_tokens} tokens)")
    return problems


def check_soak(requests: Sequence[SoakRequest], results: dict[int, StreamResult]) -> list[str]:
    """No request lost (each has one outcome), none duplicated (one id, one finish, one [DONE])."""
    problems = []
    if set(results) != {r.index for r in requests}:
        problems.append(f"lost requests: {sorted({r.index for r in requests} - set(results))[:10]}")
    ids: dict[str, int] = {}
    for index, result in sorted(results.items()):
        for response_id in result.response_ids:
            if response_id in ids:
                problems.append(f"response id {response_id} served requests {ids[response_id]} and {index}")
            ids[response_id] = index
        if result.disconnected:
            if result.error is not None:
                problems.append(f"request {index}: error before its disconnect: {result.error}")
        elif not result.complete:
            problems.append(f"request {index}: incomplete (status {result.status}, error {result.error}, "
                            f"{result.num_done} [DONE], {result.num_finish_chunks} finishes)")
        elif result.finish_reason == "length" and result.completion_tokens != requests[index].max_tokens:
            problems.append(f"request {index}: finish 'length' after {result.completion_tokens} of "
                            f"{requests[index].max_tokens} tokens")
    return problems


def build_tiny_model(out: Path, cache_dir: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (what the tests' tiny_model_dir makes)."""
    from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir

    source = resolve_model_dir(DEFAULT_MODEL, cache_dir)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            (out / name).write_bytes((source / name).read_bytes())
    return out


def summarize(results: dict[int, StreamResult]) -> dict:
    completed = [r for r in results.values() if r.complete]
    ttfts = sorted(r.first_chunk_at - r.started_at for r in completed if r.first_chunk_at)
    return {
        "completed": len(completed),
        "disconnected": sum(r.disconnected for r in results.values()),
        "errors": sum(1 for r in results.values() if r.error is not None),
        "output_tokens": sum(r.completion_tokens or 0 for r in completed),
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p99_s": ttfts[int(len(ttfts) * 0.99)] if ttfts else None,
    }


class RssMonitor:
    """Samples every service's RSS once a second, labelled with the pass under way.

    Instantaneous RSS swings with the batch in flight (a flat pass of the tiny model moved the
    model worker between 536 and 589 MiB), so the check compares each pass's peak: the soak and
    its replay carry the same load after the warm-up, so a leak raises the replay's peak and a
    warm-up effect (caches filling to their bound) does not.
    """

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.phase = "warmup"
        self.started = time.monotonic()
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.peaks: dict[str, dict[str, int]] = {}

    def sample(self) -> dict[str, int]:
        rss = stack_rss(self.stack)
        self.samples.append((time.monotonic() - self.started, rss))
        peaks = self.peaks.setdefault(self.phase, {})
        for name, value in rss.items():
            peaks[name] = max(peaks.get(name, 0), value)
        return rss

    async def run(self, every_s: float = 1.0) -> None:
        while True:
            self.sample()
            await asyncio.sleep(every_s)

    def series(self, points: int = 12) -> dict[str, list]:
        """Each service's RSS (MiB) at `points` evenly spaced samples: a leak climbs, warm-up levels off."""
        picks = [self.samples[round(i * (len(self.samples) - 1) / (points - 1))] for i in range(points)]
        series: dict[str, list] = {"t_s": [round(t, 1) for t, _ in picks]}
        for name in picks[0][1]:
            series[name] = [round(rss[name] / 2**20, 1) for _, rss in picks]
        return series


def mib(values: dict[str, int]) -> dict[str, float]:
    return {k: round(v / 2**20, 1) for k, v in values.items()}


async def soak(stack: Stack, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        model = (await client.get(f"{stack.gateway_url}/v1/models")).json()["data"][0]["id"]
    requests = plan_requests(args.requests, args.seed, args.vocab_size, args.max_prompt_tokens,
                             args.max_output_tokens, args.disconnect_fraction)
    # Warm-up as long as the soak by default: caches that fill to a bound (the KV cache's pages
    # touched for the first time; oneDNN's per-shape primitive caches, bounded in
    # model_worker/__init__.py) raise RSS before it levels off, so growth after it means
    # something is kept.
    num_warmup = args.warmup_requests if args.warmup_requests is not None else args.requests
    warmup = plan_requests(num_warmup, args.seed + 1, args.vocab_size,
                           args.max_prompt_tokens, args.max_output_tokens, args.disconnect_fraction)
    monitor = RssMonitor(stack)
    sampler = asyncio.create_task(monitor.run())
    await run_pass(stack.gateway_url, model, warmup, args.streams, with_disconnects=True)
    rss_after_warmup = monitor.sample()

    monitor.phase = "soak"
    started = time.monotonic()
    results = await run_pass(stack.gateway_url, model, requests, args.streams, with_disconnects=True)
    soak_s = time.monotonic() - started
    load_after = await asyncio.to_thread(wait_idle_load, stack.model_worker_address)
    async with httpx.AsyncClient(timeout=30) as client:
        live_after = (await client.get(f"{stack.gateway_url}/health")).json().get("live_requests")
    rss_after_soak = monitor.sample()

    monitor.phase = "replay"
    replayed = [r for r in requests if not results[r.index].disconnected]
    started = time.monotonic()
    replay = await run_pass(stack.gateway_url, model, replayed, args.streams, with_disconnects=False)
    replay_s = time.monotonic() - started
    rss_after_replay = monitor.sample()
    sampler.cancel()

    problems = check_soak(requests, results) + (compare_with_replay(results, replay) if args.compare_replay else [])
    soak_peak, replay_peak = monitor.peaks["soak"], monitor.peaks["replay"]
    growth = {name: replay_peak[name] / soak_peak[name] - 1 for name in soak_peak}
    problems += [f"{name} peak RSS grew {g:+.1%} from the soak to its replay (limit {RSS_GROWTH_LIMIT:.0%})"
                 for name, g in growth.items() if g > RSS_GROWTH_LIMIT]
    if load_after is not None and (load_after.kv_blocks_used or load_after.num_running or load_after.num_waiting):
        problems.append(f"model worker not idle after the soak: {load_after}")
    if live_after:
        problems.append(f"gateway still has {live_after} live requests after the soak")
    return {
        "streams": args.streams, "requests": args.requests, "seed": args.seed, "warmup_requests": num_warmup,
        "soak_s": round(soak_s, 2), "replay_s": round(replay_s, 2), "replay_compared": args.compare_replay,
        "soak": summarize(results),
        "replay": summarize(replay), "replayed": len(replayed),
        "kv_blocks_used_after": None if load_after is None else load_after.kv_blocks_used,
        "num_running_after": None if load_after is None else load_after.num_running,
        "kv_blocks_total": None if load_after is None else load_after.kv_blocks_total,
        "get_load": "implemented" if load_after is not None else "UNIMPLEMENTED by the model worker",
        "gateway_live_requests_after": live_after,
        "rss_mib_peak": {phase: mib(peaks) for phase, peaks in monitor.peaks.items()},
        "rss_peak_growth_soak_to_replay": {k: round(v, 4) for k, v in growth.items()},
        "rss_mib_after": {"warmup": mib(rss_after_warmup), "soak": mib(rss_after_soak),
                          "replay": mib(rss_after_replay)},
        "rss_mib_series": monitor.series(),
        "problems": problems[:50], "num_problems": len(problems),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256, help="concurrent SSE streams")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disconnect-fraction", type=float, default=0.10)
    parser.add_argument("--warmup-requests", type=int, default=None,
                        help="requests before the RSS baseline (default: --requests)")
    parser.add_argument("--max-prompt-tokens", type=int, default=200)
    parser.add_argument("--max-output-tokens", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn below this")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random model with the real tokenizer")
    parser.add_argument("--num-detok", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tokenwire"))
    parser.add_argument("--json", help="write the report here too")
    parser.add_argument("--compare-replay", action=argparse.BooleanOptionalAction, default=True,
                        help="count a completed request that differs from its replay as a problem (needs rows "
                             "whose numerics do not depend on the step's size; see --int4-small-batch below)")
    parser.add_argument("model_worker_args", nargs=argparse.REMAINDER, help="after --, model worker flags")
    args = parser.parse_args()
    worker_args = [a for a in args.model_worker_args if a != "--"]
    if "--int4-small-batch" not in worker_args:
        # Its small steps run other kernels than the larger ones, so a request's tokens depend on how
        # many sequences shared its steps, and a replay in other company may differ: the replay
        # check is of the batch-independent path unless asked otherwise.
        worker_args += ["--int4-small-batch", "off"]
    if not {"--cpu-bf16-matmul", "--batch-invariant", "--dtype", "--device"} & set(worker_args):
        # oneDNN, which auto takes where it times faster, sums a row otherwise with the step's row
        # count: replays under load differed from their runs alone (review 106). (The kernels are a
        # CPU bfloat16 path: with another dtype or device the caller chooses.)
        worker_args += ["--cpu-bf16-matmul", "kernels"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_dir = build_tiny_model(Path(tmp), Path(args.cache_dir))
            worker_args = ["--model", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                           "--max-model-len", "1024", *worker_args]
        worker_args = ["--max-num-seqs", str(args.streams), "--drain-grace-s", "5", *worker_args]
        with start_stack(worker_args, num_detok=args.num_detok, timeout_s=300,
                         gateway_args=["--log-level", "warning"]) as stack:
            report = asyncio.run(soak(stack, args))
    text = json.dumps(report, indent=2, default=lambda o: asdict(o))
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    return 1 if report["num_problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
