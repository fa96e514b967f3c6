"""The benchmark harness: metric math on synthetic timestamps, SSE token counting, and loadgen
against a small in-process OpenAI-style streaming server (and the engine-alone driver on the tiny model)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.loadgen import run_level, run_sweep
from bench.metrics import RequestRecord, distribution_ms, summarize
from bench.openai_stream import (
    ChunkTokenCounter,
    LineSplitter,
    RequestSpec,
    client_session,
    sse_data,
    sse_json,
)
from bench.prompts import Prompt, make_prompts
from bench.workload import Level, Workload, arrival_offsets

# ---------------------------------------------------------------- metrics


def test_distribution_matches_numpy_percentiles_in_ms():
    values_s = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    dist = distribution_ms(values_s)
    assert dist["mean"] == pytest.approx(50.5)
    assert dist["p50"] == pytest.approx(50.5)
    assert dist["p90"] == pytest.approx(90.1)
    assert dist["p99"] == pytest.approx(99.01)
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_ttft_tpot_and_itl_with_multi_token_chunks():
    record = RequestRecord(start=10.0, num_output_tokens=6)
    record.add_chunk(10.1, 1)   # first token: TTFT 0.1 s
    record.add_chunk(10.2, 1)   # 0.1 s later, one token
    record.add_chunk(10.5, 3)   # 0.3 s later, three tokens: 0.1 s each
    record.add_chunk(10.6, 0)   # a chunk with no token (e.g. only finish_reason) is not a token
    record.add_chunk(10.9, 1)   # 0.4 s later
    record.end = 10.9
    assert record.ttft == pytest.approx(0.1)
    assert record.e2e == pytest.approx(0.9)
    assert record.chunk_tokens == [1, 1, 3, 1]
    assert record.itls() == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.4])  # one per token after the first
    assert record.tpot == pytest.approx(0.8 / 5)


def test_extra_tokens_in_the_first_chunk_arrive_with_it():
    record = RequestRecord(start=0.0, num_output_tokens=4)
    record.add_chunk(0.5, 2)  # prefill and the next decode came out in one frame
    record.add_chunk(0.7, 2)
    record.end = 0.7
    assert record.ttft == pytest.approx(0.5)
    assert record.itls() == pytest.approx([0.0, 0.1, 0.1])
    assert record.tpot == pytest.approx(0.2 / 3)


def test_one_token_output_has_no_tpot_and_no_itl():
    record = RequestRecord(start=0.0, num_output_tokens=1)
    record.add_chunk(0.2, 1)
    record.end = 0.2
    assert record.tpot is None
    assert record.itls() == []


def test_summarize_throughputs_and_failures():
    ok = []
    for i in range(3):
        r = RequestRecord(start=float(i), num_prompt_tokens=10, num_output_tokens=4)
        r.add_chunk(i + 0.5, 2)
        r.add_chunk(i + 1.0, 2)
        r.end = i + 1.0
        ok.append(r)
    failed = RequestRecord(start=0.5, end=0.6, error="HTTP 400: bad")
    summary = summarize([*ok, failed], concurrency=2)
    assert (summary.completed, summary.failed, summary.num_requests) == (3, 1, 4)
    assert summary.duration_s == pytest.approx(3.0)  # first start 0.0 -> last end 3.0
    assert summary.output_throughput == pytest.approx(12 / 3.0)
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.total_token_throughput == pytest.approx((12 + 30) / 3.0)
    assert summary.ttft_ms["p50"] == pytest.approx(500.0)
    # ITL samples per request: [0, 0.25, 0.25] (the first chunk's second token came with the first)
    assert summary.itl_ms["mean"] == pytest.approx(500 / 3)
    assert summary.itl_ms["p50"] == pytest.approx(250.0)
    assert summary.errors == ["HTTP 400: bad"]


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    offsets = arrival_offsets(2000, rate=50.0, seed=3)
    assert offsets == arrival_offsets(2000, rate=50.0, seed=3)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert 2000 / offsets[-1] == pytest.approx(50.0, rel=0.1)


def test_levels_take_disjoint_prompt_slices():
    workload = Workload(concurrency=(1, 4), waves=2)
    levels = list(workload.levels())
    assert [(lv.concurrency, lv.num_requests, lv.first_prompt) for lv in levels] == [(1, 2, 0), (4, 8, 2)]
    pool = list(range(workload.pool_size))
    assert levels[1].prompts(pool) == list(range(2, 10))
    assert set(workload.warmup_prompts(pool)).isdisjoint(range(10))


def test_random_prompts_reencode_to_their_exact_length(smollm2):
    prompts = make_prompts(smollm2, 3, 40, seed=1)
    assert prompts == make_prompts(smollm2, 3, 40, seed=1)
    for prompt in prompts:
        assert len(prompt.token_ids) == 40
        assert smollm2.encode(prompt.text, add_special_tokens=False).ids == prompt.token_ids
    assert len({tuple(p.token_ids) for p in prompts}) == 3


# ---------------------------------------------------------------- SSE token counting


def test_chunk_counter_prefers_running_usage():
    counter = ChunkTokenCounter("completions")
    chunks = [
        {"choices": [{"text": "Hel"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
        {"choices": [{"text": "lo wor"}], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
        {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
    ]
    assert [counter.feed(c) for c in chunks] == [1, 3, 0, 0]
    assert (counter.total, counter.exact, counter.prompt_tokens) == (4, True, 5)


def test_usage_on_the_last_chunk_of_choices_alone_is_the_total_not_that_chunks_tokens():
    # llama.cpp's llama-server: usage only with its last chunk of choices. Read as a running count,
    # that chunk carried all 4 tokens again: 8 in all, and 4 extra ITL samples near 0.
    counter = ChunkTokenCounter("completions")
    chunks = [{"choices": [{"text": t}]} for t in ("a", "b", "c")] + [
        {"choices": [{"text": "d", "finish_reason": "length"}], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}]
    assert [counter.feed(c) for c in chunks] == [1, 1, 1, 1]
    assert (counter.total, counter.exact) == (4, True)


def test_chunk_counter_counts_logprob_entries():
    completions = ChunkTokenCounter("completions")
    assert completions.feed({"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}) == 2
    chat = ChunkTokenCounter("chat")
    assert chat.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == 0
    assert chat.feed({"choices": [{"delta": {"content": "xyz"}, "logprobs": {"content": [{}, {}, {}]}}]}) == 3
    assert chat.exact and completions.exact


def test_chunk_counter_guess_is_checked_against_final_usage():
    agrees = ChunkTokenCounter("chat")
    for text in ["a", "b", "c"]:
        agrees.feed({"choices": [{"delta": {"content": text}}]})
    agrees.feed({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}})
    assert (agrees.total, agrees.exact) == (3, True)
    merged = ChunkTokenCounter("completions")
    merged.feed({"choices": [{"text": "ab"}]})  # really two tokens in one chunk
    merged.feed({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}})
    assert (merged.total, merged.exact) == (2, False)
    unconfirmed = ChunkTokenCounter("completions")
    unconfirmed.feed({"choices": [{"text": "a"}]})
    unconfirmed.finish(max_tokens=2)
    assert (unconfirmed.total, unconfirmed.exact) == (1, False)
    # No usage at all (llama-cpp-python): a "length" finish means max_tokens tokens came.
    no_usage = ChunkTokenCounter("completions")
    no_usage.feed({"choices": [{"text": "a"}]})
    no_usage.feed({"choices": [{"text": "b", "finish_reason": "length"}]})
    no_usage.finish(max_tokens=2)
    assert (no_usage.total, no_usage.exact) == (2, True)
    by_words = ChunkTokenCounter("completions", count_text=lambda text: len(text.split()))
    assert by_words.feed({"choices": [{"text": " two words"}]}) == 2
    assert by_words.feed({"choices": [{"text": " "}]}) == 1  # text, so at least one token
    by_words.feed({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}})
    assert (by_words.total, by_words.exact) == (3, True)


def test_sse_lines_and_error_events():
    assert sse_data("data: [DONE]") == "[DONE]"
    with pytest.raises(ValueError, match="not a JSON object"):
        sse_json(sse_data("data: [1, 2]"))
    assert sse_data(": keep-alive") is None
    assert sse_data("") is None
    assert sse_json(sse_data('data: {"a": 1}\r')) == {"a": 1}
    with pytest.raises(Exception, match="boom"):
        ChunkTokenCounter("completions").feed({"error": {"message": "boom"}})


def test_line_splitter_joins_lines_across_pieces():
    body = 'data: {"t": "é"}\r\n\r\ndata: {"t": "x"}\n\ndata: [DONE]'.encode()
    for cut in range(1, len(body)):  # every split point, inside the two-byte é too
        lines = LineSplitter()
        got = lines.feed(body[:cut]) + lines.feed(body[cut:]) + lines.rest()
        assert got == ['data: {"t": "é"}\r', "\r", 'data: {"t": "x"}', "", "data: [DONE]"], cut
    lines = LineSplitter()
    assert [lines.feed(bytes([b])) for b in b"ab\n"] == [[], [], ["ab"]]
    assert lines.rest() == []
    bounded = LineSplitter(max_line_bytes=8)
    assert bounded.feed(b"12345678\n123") == ["12345678"]
    with pytest.raises(ValueError, match="over 8 bytes"):
        bounded.feed(b"456789")


# ---------------------------------------------------------------- loadgen against a fake server


class FakeServer:
    """Streams `max_tokens` tokens as chunks of 1, 2, 1, 2, ... tokens, 5 ms apart, and records the
    most requests it ever had in flight. usage per chunk only when continuous_usage_stats is asked."""

    def __init__(self, continuous_usage: bool = True, fault: str | None = None) -> None:
        self.continuous_usage = continuous_usage
        # A broken server: "short" (stops after 3 tokens, finish_reason stop), "no_done" (ends the
        # body after 3 tokens without [DONE]), "not_object" (a data line that is a JSON string),
        # "stall" (sends 1 token, then nothing, the connection open); "unterminated" (well formed, but
        # the body ends on [DONE] with no line end).
        self.fault = fault
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.first_use: dict[int, str] = {}  # client port -> path of the first request on that connection
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)

    async def models(self, request: Request) -> dict:
        self.first_use.setdefault(request.client.port, "models")
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def completions(self, request: Request):
        self.first_use.setdefault(request.client.port, "completions")
        body = await request.json()
        self.bodies.append(body)
        if body["model"] != "fake-model":
            return JSONResponse({"error": {"message": "no such model", "type": "invalid_request_error"}}, 400)
        options = body.get("stream_options") or {}
        running_usage = self.continuous_usage and options.get("continuous_usage_stats")
        num_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())

        async def events():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                sent, size = 0, 1
                if self.fault == "not_object":
                    yield 'data: "hello"\n\n'
                while sent < body["max_tokens"]:
                    await asyncio.sleep(0.005)
                    if self.fault == "stall" and sent:
                        await asyncio.sleep(30)
                    if self.fault in ("short", "no_done") and sent >= 3:
                        break
                    n = min(size, body["max_tokens"] - sent)
                    sent += n
                    chunk = {"choices": [{"index": 0, "text": "x" * n, "finish_reason": None}]}
                    if running_usage:
                        chunk["usage"] = {"prompt_tokens": num_prompt, "completion_tokens": sent}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    size = 3 - size  # 1, 2, 1, 2, ...
                if self.fault == "no_done":
                    return
                if self.fault == "short":
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'stop'}]})}\n\n"
                if options.get("include_usage"):
                    usage = {"prompt_tokens": num_prompt, "completion_tokens": sent}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]" if self.fault == "unterminated" else "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def serve():
    """Runs a FakeServer with uvicorn on a free loopback port in a thread; yields (server, base_url)."""
    running = []

    def start(fake: FakeServer) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 5
        while not server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        running.append((server, thread))
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(5)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(token_ids=[100 + i, 200, 300], text=f"w{i} b c") for i in range(n)]


def test_loadgen_sweep_counts_multi_token_chunks_exactly(serve):
    fake = FakeServer()
    base_url = serve(fake)
    workload = Workload(prompt_len=3, output_tokens=7, concurrency=(1, 4), waves=2)
    spec = RequestSpec("completions", "", workload.output_tokens)
    pool = _prompts(workload.pool_size)
    summaries = asyncio.run(run_sweep(base_url, spec, workload, pool, warmup_requests=1, log=lambda _: None))

    assert fake.bodies[0]["max_tokens"] == 4  # the warm-up request is short
    sent = fake.bodies[1:]
    assert all(b["model"] == "fake-model" and b["ignore_eos"] and b["temperature"] == 0.0 for b in sent)
    assert [b["prompt"] for b in sent[:2]] == ["w0 b c", "w1 b c"]  # level 1 takes the pool's first slice
    assert fake.max_in_flight <= 4
    assert [s.concurrency for s in summaries] == [1, 4]
    assert [s.completed for s in summaries] == [2, 8]
    for s in summaries:
        assert s.failed == 0
        assert s.total_output_tokens == 7 * s.completed
        assert s.exact_token_counts == s.completed
        assert s.mean_prompt_tokens == 3
        # 7 tokens in chunks of 1,2,1,2,1 about 5 ms apart: ITLs of ~5 and ~2.5 ms, none near 0.
        assert 1.0 < s.itl_ms["p50"] < 200
        assert s.ttft_ms["p50"] > 4.0
        assert s.tpot_ms["mean"] is not None and s.output_throughput > 0
        assert s.client_cpu_s is not None and s.client_cpu_s > 0  # the client's own CPU over the level
    # Each level found its connections open (GET /models): no timed request opened one; only
    # the warm-up before them did.
    assert list(fake.first_use.values()).count("completions") <= 1
    assert len(fake.first_use) >= 4


def test_loadgen_without_per_chunk_usage_guesses_and_checks_the_total(serve):
    base_url = serve(FakeServer(continuous_usage=False))
    spec = RequestSpec("completions", "fake-model", 5, prompt_format="ids")
    records = asyncio.run(_run_level(base_url, spec, _prompts(3), Level(3, None, 3)))
    for record in records:
        assert record.ok
        assert record.num_output_tokens == 5  # from the final usage chunk
        assert record.chunk_tokens == [1, 1, 1, 1]  # 4 chunks really carrying 1, 2, 1, 1 tokens
        assert not record.exact_token_counts
    # Re-encoding each chunk's text (the fake's tokens are one "x" each) recovers the real counts.
    records = asyncio.run(_run_level(base_url, spec, _prompts(2), Level(2, None, 2), count_text=len))
    for record in records:
        assert record.chunk_tokens == [1, 2, 1, 1]
        assert record.exact_token_counts and record.num_output_tokens == 5


def test_loadgen_rate_mode_and_http_errors(serve):
    fake = FakeServer()
    base_url = serve(fake)
    records = asyncio.run(_run_level(base_url, RequestSpec("completions", "fake-model", 2), _prompts(5),
                                     Level(None, 200.0, 5)))
    assert all(r.ok and r.num_output_tokens == 2 for r in records)
    starts = [r.start for r in records]
    assert starts == sorted(starts)
    bad = asyncio.run(_run_level(base_url, RequestSpec("completions", "other", 2), _prompts(2), Level(2, None, 2)))
    assert all(not r.ok and r.error.startswith("HTTP 400") and "no such model" in r.error for r in bad)
    assert summarize(bad, 2).failed == 2


@pytest.mark.parametrize("fault, error", [
    ("short", "3 output tokens, not the 8 asked (finish_reason stop)"),
    ("no_done", "the stream ended without data: [DONE]"),
    ("not_object", "SSE data is not a JSON object"),
    ("stall", "TimeoutError"),
])
def test_a_broken_stream_fails_its_request_instead_of_passing_or_ending_the_sweep(serve, fault, error):
    # Each of these counted as a success (short, no_done), raised out of the whole level
    # (not_object) or hung it for good (stall).
    base_url = serve(FakeServer(fault=fault))
    records = asyncio.run(_run_level(base_url, RequestSpec("completions", "fake-model", 8), _prompts(2),
                                     Level(2, None, 2), read_timeout_s=1.0))
    assert [r.ok for r in records] == [False, False]
    assert all(error in r.error for r in records), [r.error for r in records]
    assert summarize(records, 2).failed == 2


def test_a_last_line_without_its_line_end_still_counts(serve):
    base_url = serve(FakeServer(fault="unterminated"))
    records = asyncio.run(_run_level(base_url, RequestSpec("completions", "fake-model", 5), _prompts(2),
                                     Level(2, None, 2)))
    assert [(r.ok, r.num_output_tokens, r.chunk_tokens) for r in records] == [(True, 5, [1, 2, 1, 1])] * 2


def test_a_short_output_is_fine_where_the_run_does_not_ask_for_a_fixed_length(serve):
    base_url = serve(FakeServer(fault="short"))
    spec = RequestSpec("completions", "fake-model", 8, ignore_eos=False)
    assert not spec.fixed_length
    assert RequestSpec("completions", "m", 8, ignore_eos=False, extra_body={"min_tokens": 8}).fixed_length
    records = asyncio.run(_run_level(base_url, spec, _prompts(2), Level(2, None, 2)))
    assert all(r.ok and r.num_output_tokens == 3 for r in records)


async def _run_level(base_url: str, spec: RequestSpec, prompts: list[Prompt], level: Level,
                     count_text=None, read_timeout_s: float = 10.0) -> list[RequestRecord]:
    async with client_session(timeout_s=10, read_timeout_s=read_timeout_s) as client:
        return await run_level(client, base_url + spec.path, spec, prompts, level, count_text=count_text)


# ---------------------------------------------------------------- engine alone


def test_engine_alone_driver_on_the_tiny_model(tiny_model_dir, smollm2):
    from bench.engine_alone import EngineDriver, build_engine
    from model_worker.config import Config

    engine, _ = build_engine(Config(model=str(tiny_model_dir), load_format="dummy", max_num_seqs=4,
                                    max_model_len=64, dtype="float32", device="cpu"))
    workload = Workload(prompt_len=8, output_tokens=5, concurrency=(2,), waves=3)
    pool = make_prompts(smollm2, workload.pool_size, workload.prompt_len)
    driver = EngineDriver(engine, workload.output_tokens)
    driver.warm_up(workload.warmup_prompts(pool)[:1])
    (level,) = workload.levels()
    records = driver.run_level(level.prompts(pool), level)
    assert len(records) == 6
    for record in records:
        assert record.ok and record.num_output_tokens == 5
        assert record.chunk_tokens == [1] * 5  # one token per step
        assert record.start <= record.chunk_times[0] <= record.end
    # Closed loop at concurrency 2: the third request starts only after one of the first two ended.
    first_two_end = sorted(r.end for r in records[:2])[0]
    assert records[2].start >= first_two_end
    assert np.isfinite(summarize(records, 2).output_throughput)


async def test_model_worker_direct_driver_on_the_tiny_model(tiny_model_dir, smollm2):
    import grpc

    from bench.model_worker_direct import GenerateStreamDriver, run_sweep
    from tests.conftest import tiny_model_worker
    from tokenwire.v1 import model_worker_pb2_grpc as pb_grpc

    workload = Workload(prompt_len=8, output_tokens=5, concurrency=(2,), waves=3)
    pool = make_prompts(smollm2, workload.pool_size, workload.prompt_len)
    (level,) = workload.levels()
    with tiny_model_worker(tiny_model_dir, "--max-num-seqs", "4", "--max-model-len", "64") as address:
        async with grpc.aio.insecure_channel(address) as channel:
            driver = GenerateStreamDriver(pb_grpc.ModelWorkerStub(channel).Generate(), workload.output_tokens)
            records = await driver.run_level(level.prompts(pool), level)
            # A request the worker refuses (longer than the context) is recorded as failed, not waited on.
            refused = await driver.request(Prompt(text="", token_ids=[1] * 80), 5)
            await driver.close()
        summaries, info = await run_sweep(address, workload, pool, log=lambda line: None)
    assert len(records) == 6
    for record in records:
        assert record.ok and record.num_output_tokens == 5 and sum(record.chunk_tokens) == 5
        assert record.start <= record.chunk_times[0] <= record.end
    # Closed loop at concurrency 2: the third request starts only after one of the first two ended.
    assert records[2].start >= min(r.end for r in records[:2])
    assert refused.error is not None and "FINISH_REASON_ERROR" in refused.error and not refused.ok
    (summary,) = summaries
    assert summary.completed == 6 and summary.output_throughput > 0
    assert info.max_model_len == 64


# ---------------------------------------------------------------- side-by-side table and targets


def _report(label: str, tok_s: dict[int, float], ttft_p50: float = 10.0, tpot_p50: float = 5.0) -> dict:
    dist = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {"label": label, "levels": [
        {"concurrency": c, "request_rate": None, "output_throughput": t, "request_throughput": 1.0,
         "completed": c, "num_requests": c, "ttft_ms": {**dist, "p50": ttft_p50}, "tpot_ms": {**dist, "p50": tpot_p50},
         "itl_ms": dist} for c, t in tok_s.items()]}


def test_comparison_table_ratios_and_targets():
    from bench.comparison import comparison_table, target_checks

    reports = {
        "tokenwire": _report("tw", {1: 20.0, 32: 480.0}, ttft_p50=11.5, tpot_p50=8.0),
        "engine": _report("engine", {1: 21.0, 32: 500.0}, ttft_p50=10.0),
        "hf_static": _report("hf", {1: 20.0, 32: 150.0}),
        "llama_cpp": _report("llama", {1: 100.0, 32: 100.0}, tpot_p50=10.0),
    }
    workload = Workload(concurrency=(1, 32))
    table = comparison_table(reports, workload)
    assert "| 32 | tokenwire (gateway) | 480.0 | 3.20x |" in table
    assert "| 1 | llama-cpp-python server | 100.0 | 5.00x |" in table
    checks = "\n".join(target_checks(reports, workload))
    assert "static output tok/s at 32 streams: 3.20 (target >= 3) -> met" in checks
    assert "llama-cpp-python server output tok/s at 32 streams: 4.80 (target >= 4) -> met" in checks
    assert "engine-alone output tok/s at 32 streams: 0.96 (target >= 0.95) -> met" in checks
    assert "decode tok/s (1 / TPOT p50) at 1 stream: 1.25 (target >= 1) -> met" in checks
    assert "gateway + detok (ms) at 1 streams: 1.50 (target <= 2) -> met" in checks
    del reports["hf_static"]
    reports["tokenwire"]["levels"][1]["output_throughput"] = 300.0
    checks = "\n".join(target_checks(reports, workload))
    assert "static" not in checks  # a missing system leaves its check out
    assert "at 32 streams: 0.60 (target >= 0.95) -> NOT met" in checks


def test_best_of_keeps_each_levels_fastest_run_and_the_spread():
    from bench.comparison import best_of, comparison_table

    runs = [_report("tw", {1: 10.0, 8: 80.0}, ttft_p50=50.0), _report("tw", {1: 12.0, 8: 60.0}, ttft_p50=40.0)]
    merged = best_of(runs)
    assert merged["repeats"] == 2
    levels = {lv["concurrency"]: lv for lv in merged["levels"]}
    assert levels[1]["output_throughput"] == 12.0 and levels[1]["ttft_ms"]["p50"] == 40.0
    assert levels[8]["output_throughput"] == 80.0 and levels[8]["ttft_ms"]["p50"] == 50.0
    assert levels[8]["output_throughput_runs"] == [80.0, 60.0]
    table = comparison_table({"tokenwire": merged}, Workload(concurrency=(1, 8)))
    assert "| 8 | tokenwire (gateway) | 80.0 (60.0-80.0) | - |" in table


def test_rounds_that_lost_requests_are_not_the_best_and_not_a_term_of_a_target():
    from bench.comparison import best_of, target_checks

    clean, lossy = _report("tw", {32: 1100.0}), _report("tw", {32: 1450.0})
    lossy["levels"][0]["failed"] = 12
    clean["levels"][0]["failed"] = 0
    merged = best_of([clean, lossy])
    assert merged["levels"][0]["output_throughput"] == 1100.0
    assert merged["levels"][0]["output_throughput_runs"] == [1100.0, 1450.0]
    engine = _report("engine", {32: 1500.0})
    engine["levels"][0]["failed"] = 0
    workload = Workload(concurrency=(32,))
    assert "engine-alone output tok/s at 32 streams: 0.73" in "\n".join(
        target_checks({"tokenwire": merged, "engine": engine}, workload))
    assert not target_checks({"tokenwire": lossy, "engine": engine}, workload)


def test_rate_levels_under_one_concurrency_cap_stay_apart():
    # --request-rate 2,4,8 --max-concurrency 32: every level had concurrency 32, and they were
    # merged into one (best_of kept one, the side-by-side table was empty).
    from bench.comparison import best_of
    from bench.report import level_x

    levels = [{"concurrency": 32, "request_rate": rate, "output_throughput": rate * 10} for rate in (2.0, 4.0, 8.0)]
    assert [level_x(level) for level in levels] == [2.0, 4.0, 8.0]
    merged = best_of([{"label": "tw", "levels": levels}, {"label": "tw", "levels": levels}])
    assert [level["request_rate"] for level in merged["levels"]] == [2.0, 4.0, 8.0]


def test_engine_alone_stamps_an_arrival_at_its_scheduled_time():
    """An arrival that falls due while a step runs is seen only after it; through the gateway it
    waits in the server for that step, so its TTFT counts the wait: so does the engine alone's."""
    from bench.engine_alone import EngineDriver
    from bench.prompts import Prompt
    from bench.workload import Level
    from model_worker.engine import SequenceOutput
    from model_worker.sequence import FinishReason

    class SlowEngine:  # each step 50 ms; one token per live request per step, 2 tokens each
        def __init__(self):
            self.live: dict[int, int] = {}

        def add_request(self, seq_id, *args, **kwargs):
            self.live[seq_id] = 0

        def has_work(self):
            return bool(self.live)

        def step(self):
            time.sleep(0.05)
            outputs = []
            for seq_id in list(self.live):
                self.live[seq_id] += 1
                done = self.live[seq_id] == 2
                outputs.append(SequenceOutput(seq_id, 7, num_output_tokens=self.live[seq_id],
                                              finish_reason=FinishReason.LENGTH if done else FinishReason.NONE))
                if done:
                    del self.live[seq_id]
            return outputs

    level = Level(None, 40.0, 4, 0)  # Poisson at 40/s: most arrive while a 50 ms step runs
    prompts = [Prompt([5, 6], "x")] * 4
    records = EngineDriver(SlowEngine(), 2).run_level(prompts, level, seed=1)
    from bench.workload import arrival_offsets

    offsets = arrival_offsets(4, 40.0, 1)
    first = records[0].start - offsets[0]  # the level's start
    for record, offset in zip(records, offsets, strict=True):
        assert record.start == pytest.approx(first + offset, abs=1e-3)
    assert max(r.ttft for r in records) > 0.05  # one waited for a step already running


def test_side_by_side_runner_puts_json_before_the_model_worker_flags(tmp_path):
    import sys

    from bench.side_by_side import Runner

    # A stand-in system: writes an empty report to the path after --json, and its argv next to it.
    script = ("import json, sys; a = sys.argv[1:]; out = a[a.index('--json') + 1]; "
              "json.dump({'label': 'x', 'levels': [], 'argv': a}, open(out, 'w'))")
    runner = Runner(tmp_path, timeout_s=30, repeats=2)
    runner.round = 1
    path = runner.run("engine", [sys.executable, "-c", script, "--flag", "--", "--max-num-seqs", "8"])
    assert path == tmp_path / "engine-1.json"
    argv = json.loads(path.read_text())["argv"]
    assert argv == ["--flag", "--json", str(path), "--", "--max-num-seqs", "8"]
    assert (tmp_path / "engine-1.log").is_file()
    assert runner.run("hf_static", [sys.executable, "-c", "raise SystemExit(3)"]) is None
    assert "exit code 3" in runner.notes["hf_static"]


def test_generate_batch_requests_are_timed_from_their_creation_not_from_the_call():
    # generate_batch builds its manager, cache and warm-up before it makes the requests: timed
    # from the call, that setup was 17-34% of every TTFT the baseline reported.
    from types import SimpleNamespace

    from bench.hf_baselines import run_continuous

    class SlowToStart:
        generation_config = SimpleNamespace(pad_token_id=0)

        def generate_batch(self, inputs, generation_config, cb_config, **kwargs):
            time.sleep(0.05)  # the manager's setup
            created = time.perf_counter()
            return {f"r{i}": SimpleNamespace(generated_tokens=[1, 2], error=None, created_time=created,
                                             timestamps=[created + 0.01, created + 0.02])
                    for i, _ in enumerate(inputs)}

    called = time.perf_counter()
    records = run_continuous(SlowToStart(), _prompts(2), Level(2, None, 2), output_tokens=2)
    assert all(r.start >= called + 0.05 for r in records)
    assert all(r.ttft == pytest.approx(0.01) and r.num_output_tokens == 2 for r in records)
