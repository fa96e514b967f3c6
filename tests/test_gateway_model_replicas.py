"""The gateway over several model worker replicas (--model-workers A,B): per-request least-loaded
placement, adds and aborts sticking to the request's replica, losing one replica failing only its
own streams, its return, a replica serving another model refused, a full replica passed over,
and /ready listing what is down.

In-process and quick: the real gateway app (uvicorn on loopback) and the real detok servicer,
in front of scripted model workers on real gRPC servers. Each fake answers every running request
with one token per step, and each replica its own token ("A" or "B"), so a stream's text says
which replica served it. One slow test repeats the loss with real processes (kill -9). Figures
are printed; run with -s to see them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn

from bench.soak import StreamResult, stream_completion
from detok_worker.servicer import DetokenizerServicer
from gateway import replica_set
from gateway.app import create_app
from gateway.config import Config, dns_name
from gateway.model_worker_client import ModelWorkerClient
from gateway.pipeline import Pipeline
from tests.test_gateway_metrics import sample
from tokenwire import grpc_server
from tokenwire.grpc_tls import add_port
from tokenwire.packing import pack_int32
from tokenwire.stack import free_port, start_stack, wait_grpc_serving
from tokenwire.tokenizer_files import tokenizer_identity
from tokenwire.v1 import detok_worker_pb2_grpc, model_worker_pb2, model_worker_pb2_grpc

TOKEN_OF = {"A": 49, "B": 50}  # SmolLM2's ids of "A" and "B"
STEP_S = 0.01  # one token per running request per step
LONG = 4000  # tokens (40 s at STEP_S): runs until the test ends it
# A stream cut by a lost replica must end with its error event within this (measured: ms).
ABORT_LIMIT_S = 2.0
# From a replica's restart to the gateway placing requests on it again: gRPC's reconnect
# backoff (0.25 s, x1.6) plus the stream's 0.5 s retry and the ModelInfo check.
RECOVER_LIMIT_S = 6.0
DNS_ENTRY = "dns:///model-workers.test:50051"
DETOK_DNS_ENTRY = "dns:///detok-workers.test:50052"


class FakeModelWorker(model_worker_pb2_grpc.ModelWorkerServicer):
    """Runs every added request for max_tokens steps, one `token_id` per step; with `capacity`,
    an add beyond that many running requests is refused as a full queue."""

    def __init__(self, info: model_worker_pb2.ModelInfo, token_id: int, capacity: int | None = None) -> None:
        self.info = info
        self.token_id = token_id
        self.capacity = capacity
        self.adds: list[str] = []
        self.aborts: list[str] = []
        self.refused: list[str] = []
        self.running: dict[str, list[int]] = {}  # request_id -> [tokens sent, max_tokens]
        self.hold = False  # keep added requests waiting: no tokens until it is cleared

    async def GetModelInfo(self, request, context):
        return self.info

    async def GetLoad(self, request, context):
        return model_worker_pb2.WorkerLoad(num_running=len(self.running), max_waiting=self.capacity or 0)

    async def Generate(self, request_iterator, context):
        refusals: list[model_worker_pb2.SequenceTokens] = []

        async def read() -> None:
            async for frame in request_iterator:
                for add in frame.adds:
                    self.adds.append(add.request_id)
                    if self.capacity is not None and len(self.running) >= self.capacity:
                        self.refused.append(add.request_id)
                        refusals.append(model_worker_pb2.SequenceTokens(
                            request_id=add.request_id, finish_reason=model_worker_pb2.FINISH_REASON_ERROR,
                            error=model_worker_pb2.RequestError(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                                                message="the waiting queue is full")))
                    else:
                        self.running[add.request_id] = [0, add.max_tokens]
                for abort in frame.aborts:
                    self.aborts.append(abort.request_id)
                    self.running.pop(abort.request_id, None)

        reader = asyncio.create_task(read())
        try:
            while not reader.done():
                await asyncio.sleep(STEP_S)
                sequences = refusals[:]
                refusals.clear()
                for request_id, progress in list(self.running.items()):
                    if self.hold:
                        break
                    progress[0] += 1
                    done = progress[0] >= progress[1]
                    sequences.append(model_worker_pb2.SequenceTokens(
                        request_id=request_id, token_ids=pack_int32([self.token_id]), num_output_tokens=progress[0],
                        finish_reason=model_worker_pb2.FINISH_REASON_LENGTH if done else 0))
                    if done:
                        del self.running[request_id]
                if sequences:
                    yield model_worker_pb2.TokenFrame(sequences=sequences)
            reader.result()
        finally:
            reader.cancel()


async def start_server(address: str, add_servicer: Callable[[grpc.aio.Server], None]) -> grpc.aio.Server:
    server = grpc_server.new_server()
    add_servicer(server)
    health = grpc_server.add_health_and_reflection(server, [])
    await grpc_server.mark_serving(health, [])
    add_port(server, address, None)
    await server.start()
    return server


@dataclass
class Replica:
    name: str
    address: str
    fake: FakeModelWorker
    server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = await start_server(
            self.address, lambda s: model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(self.fake, s))

    async def stop(self) -> None:
        """Like kill -9 as the gateway sees it: every call is cut at once."""
        assert self.server is not None
        await self.server.stop(None)
        self.server = None


@dataclass
class Rig:
    url: str
    app: object
    replicas: dict[str, Replica]
    detok_servers: list[grpc.aio.Server] = field(default_factory=list)
    detok_down: list[str] = field(default_factory=list)
    detok_addresses: list[str] = field(default_factory=list)

    @property
    def pipeline(self) -> Pipeline:
        return self.app.state.pipeline

    def client_of(self, name: str) -> ModelWorkerClient:
        (client,) = [r for r in self.pipeline.model_workers.replicas if r.address == self.replicas[name].address]
        return client

    def body(self, max_tokens: int) -> dict:
        return {"model": "fake", "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}

    def unary_body(self, max_tokens: int) -> dict:
        return {"model": "fake", "prompt": [1, 2, 3], "max_tokens": max_tokens}

    async def stream(self, client: httpx.AsyncClient, max_tokens: int,
                     first_chunk: asyncio.Event | None = None) -> StreamResult:
        return await stream_completion(client, f"{self.url}/v1/completions", self.body(max_tokens),
                                       first_chunk=first_chunk)

    async def open_streams(self, client: httpx.AsyncClient, count: int,
                           max_tokens: int = LONG) -> list[asyncio.Task[StreamResult]]:
        """`count` streams, returned once each has its first output chunk."""
        started = [asyncio.Event() for _ in range(count)]
        tasks = [asyncio.create_task(self.stream(client, max_tokens, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
        return tasks


def model_info(tokenizer_dir: Path, **changes) -> model_worker_pb2.ModelInfo:
    info = model_worker_pb2.ModelInfo(model_id="fake", vocab_size=49152, max_model_len=4096,
                                      tokenizer=tokenizer_identity(tokenizer_dir), eos_token_ids=[2])
    for name, value in changes.items():
        if isinstance(value, list):
            getattr(info, name)[:] = value
        else:
            setattr(info, name, value)
    return info


@asynccontextmanager
async def rig(tokenizer_dir: Path, infos: dict[str, model_worker_pb2.ModelInfo] | None = None,
              capacities: dict[str, int] | None = None, num_detok: int = 1,
              dns: list[str] | None = None, num_detok_down: int = 0,
              detok_dns: list[str] | None = None) -> AsyncIterator[Rig]:
    """Replicas A and B, detok replicas and the gateway; with `dns`, the gateway is given DNS_ENTRY
    instead of the two addresses, and `dns` (what the name resolves to) starts as [A]; with
    `detok_dns`, likewise DETOK_DNS_ENTRY instead of the detok addresses (Rig.detok_addresses),
    starting as the first. The gateway also lists `num_detok_down` detok addresses that nothing
    serves (Rig.detok_down)."""
    infos = infos or {}
    capacities = capacities or {}
    replicas = {name: Replica(name, f"127.0.0.1:{free_port()}",
                              FakeModelWorker(infos.get(name, model_info(tokenizer_dir)), TOKEN_OF[name],
                                              capacities.get(name)))
                for name in ("A", "B")}
    for replica in replicas.values():
        await replica.start()
    detok_addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_detok)]
    detok_servers = [await start_server(a, lambda s: detok_worker_pb2_grpc.add_DetokenizerServicer_to_server(
        DetokenizerServicer(), s)) for a in detok_addresses]
    port = free_port()
    # A is listed first, so it is the replica whose model the gateway serves.
    model_workers = [replicas["A"].address, replicas["B"].address]
    if dns is not None:
        dns[:] = [replicas["A"].address]
        model_workers = [DNS_ENTRY]
    detok_down = [f"127.0.0.1:{free_port()}" for _ in range(num_detok_down)]
    detok_workers = detok_addresses + detok_down
    if detok_dns is not None:
        detok_dns[:] = detok_addresses[:1]
        detok_workers = [DETOK_DNS_ENTRY]
    config = Config(port=port, model_workers=model_workers, model_worker_dns_refresh_s=0.05,
                    detok_workers=detok_workers, detok_worker_dns_refresh_s=0.05, startup_timeout_s=20,
                    log_level="warning")
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise AssertionError("the gateway exited at start")
            await asyncio.sleep(0.02)
        yield Rig(f"http://127.0.0.1:{port}", app, replicas, detok_servers, detok_down, detok_addresses)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)
        for replica in replicas.values():
            if replica.server is not None:
                await replica.stop()
        for detok in detok_servers:
            await detok.stop(None)


def served_by(result: StreamResult) -> str:
    """Which replica's token the stream's text is made of ("A", "B", or "" if mixed or empty)."""
    letters = set(result.text)
    return letters.pop() if len(letters) == 1 else ""


async def wait_for(predicate: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_requests_spread_over_replicas_and_adds_aborts_and_frames_stick(tiny_model_dir: Path) -> None:
    async with rig(tiny_model_dir) as r, httpx.AsyncClient(timeout=30) as client:
        a, b = r.replicas["A"].fake, r.replicas["B"].fake
        await wait_for(lambda: r.client_of("B").connected, 5)
        # Least loaded first, ties round robin: 8 concurrent requests split 4 / 4.
        tasks = await r.open_streams(client, 8, max_tokens=50)
        assert len(a.adds) == len(b.adds) == 4 and not set(a.adds) & set(b.adds)
        assert {r.pipeline._live[rid].model.address for rid in a.adds} == {r.replicas["A"].address}
        # B's stream naming requests that run on A (tokens, even a finish): not B's to deliver.
        r.client_of("B").stream._on_frame(model_worker_pb2.TokenFrame(sequences=[
            model_worker_pb2.SequenceTokens(request_id=rid, token_ids=pack_int32([TOKEN_OF["B"]]), num_output_tokens=1,
                                            finish_reason=model_worker_pb2.FINISH_REASON_LENGTH)
            for rid in a.adds]))
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(res.complete and res.completion_tokens == 50 for res in results), results
        assert sorted(served_by(res) for res in results) == ["A"] * 4 + ["B"] * 4

        # Client disconnects: each abort goes to the replica running the request.
        tasks = await r.open_streams(client, 4)
        on_a, on_b = set(a.adds[4:]), set(b.adds[4:])
        assert len(on_a) == len(on_b) == 2
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: len(a.aborts) + len(b.aborts) == 4, 2)
        assert set(a.aborts) == on_a and set(b.aborts) == on_b
        assert not a.running and not b.running
        await wait_for(lambda: all(c.num_sequences == 0 for c in r.pipeline.model_workers.replicas), 2)
        metrics = (await client.get(f"{r.url}/metrics")).text
        for name in ("A", "B"):
            worker = r.replicas[name].address
            assert sample(metrics, "tokenwire:gateway_model_worker_connected", worker=worker) == 1
            assert sample(metrics, "tokenwire:gateway_model_worker_sequences", worker=worker) == 0
            assert sample(metrics, "tokenwire:num_requests_running", worker=worker) == 0


async def test_losing_a_replica_fails_only_its_streams_then_it_takes_requests_again(tiny_model_dir: Path) -> None:
    async with rig(tiny_model_dir) as r, httpx.AsyncClient(timeout=30) as client:
        a, b = r.replicas["A"], r.replicas["B"]
        await wait_for(lambda: r.client_of("B").connected, 5)
        tasks = await r.open_streams(client, 6, max_tokens=150)  # 1.5 s of tokens; 3 on each
        killed_at = time.monotonic()
        await a.stop()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        failed = [res for res in results if res.error is not None]
        completed = [res for res in results if res.complete]
        assert len(failed) == 3 and len(completed) == 3, results
        for res in failed:
            assert res.status == 200 and res.num_done == 1 and res.num_finish_chunks == 0
            # gRPC's status, not the replica's internal address (the gateway's log names it).
            assert res.error["message"].startswith("lost the model worker stream (") and served_by(res) == "A"
            assert a.address not in res.error["message"]
        assert all(res.completion_tokens == 150 and served_by(res) == "B" for res in completed)
        time_to_error = max(res.ended_at for res in failed) - killed_at
        assert time_to_error < ABORT_LIMIT_S
        assert min(res.ended_at for res in completed) > max(res.ended_at for res in failed)

        # Ready on B alone, saying A is down; new requests all go to B.
        ready = await client.get(f"{r.url}/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["model_workers"] == [b.address]
        assert any(a.address in down for down in ready.json()["down"])
        adds_before = len(b.fake.adds)
        news = await asyncio.gather(*(r.stream(client, 5) for _ in range(4)))
        assert all(res.complete and served_by(res) == "B" for res in news), news
        assert len(b.fake.adds) == adds_before + 4

        restarted_at = time.monotonic()
        a.fake = FakeModelWorker(a.fake.info, TOKEN_OF["A"])  # a fresh process
        await a.start()
        await wait_for(lambda: r.client_of("A").connected, RECOVER_LIMIT_S)
        reconnect_s = time.monotonic() - restarted_at
        after = await asyncio.gather(*(r.stream(client, 5) for _ in range(4)))
        assert all(res.complete for res in after) and a.fake.adds, after
        assert (await client.get(f"{r.url}/ready")).json()["down"] == []
    print(f"\n[figure] one of 2 model worker replicas lost: its 3 streams ended with an error event "
          f"{time_to_error * 1000:.0f} ms later, the other 3 completed; restart to taking requests "
          f"{reconnect_s:.2f}s")


async def test_a_request_a_lost_replica_never_answered_runs_on_another(tiny_model_dir: Path) -> None:
    """Queued on A (no token yet) when A goes: added on B from the start, not failed with 503. A
    request A had answered fails as before (its tokens reached the client)."""
    async with rig(tiny_model_dir) as r, httpx.AsyncClient(timeout=30) as client:
        a, b = r.replicas["A"], r.replicas["B"]
        await wait_for(lambda: r.client_of("B").connected, 5)
        client_b = r.client_of("B")
        client_b.num_sequences += 5  # so both land on A
        try:
            answered = await r.open_streams(client, 1, max_tokens=150)
            a.fake.hold = True
            queued = asyncio.create_task(r.stream(client, 5))
            await wait_for(lambda: len(a.fake.adds) == 2, 5)
        finally:
            client_b.num_sequences -= 5
        await a.stop()
        moved, failed = await asyncio.wait_for(asyncio.gather(queued, *answered), 10)
        assert moved.complete and moved.error is None and served_by(moved) == "B", moved
        assert moved.completion_tokens == 5
        assert b.fake.adds == [a.fake.adds[1]]  # the same request id, added again
        assert failed.error is not None and "lost the model worker stream" in failed.error["message"], failed


async def test_a_replica_serving_another_model_is_refused(tiny_model_dir: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="gateway.model_worker_client")
    other = model_info(tiny_model_dir, model_id="other", max_model_len=2048)
    async with rig(tiny_model_dir, infos={"B": other}) as r, httpx.AsyncClient(timeout=30) as client:
        b = r.replicas["B"]
        await wait_for(lambda: bool(r.client_of("B").refusal), 5)
        assert "model_id 'other'" in r.client_of("B").refusal and "max_model_len 2048" in r.client_of("B").refusal
        (line,) = [rec.getMessage() for rec in caplog.records if b.address in rec.getMessage()]
        assert "refused" in line and "model_id 'other'" in line
        results = await asyncio.gather(*(r.stream(client, 5) for _ in range(4)))
        assert all(res.complete and served_by(res) == "A" for res in results), results
        assert b.fake.adds == []
        ready = await client.get(f"{r.url}/ready")
        assert ready.status_code == 200 and ready.json()["model"] == "fake"
        (down,) = ready.json()["down"]
        assert b.address in down and "different model" in down


def test_replicas_that_stop_outputs_at_other_ids_do_not_share_requests(tiny_model_dir: Path) -> None:
    from gateway.model_worker_client import model_mismatch

    same = model_info(tiny_model_dir)
    assert model_mismatch(same, model_info(tiny_model_dir)) == ""
    assert model_mismatch(model_info(tiny_model_dir, eos_token_ids=[2, 0]),
                          model_info(tiny_model_dir, eos_token_ids=[0, 2])) == ""  # a set
    assert model_mismatch(same, model_info(tiny_model_dir, eos_token_ids=[0, 2, 5])) == \
        "eos_token_ids [0, 2, 5] (expected [2])"


async def test_a_full_replica_hands_its_request_to_one_with_room_and_429_only_when_all_are_full(
        tiny_model_dir: Path) -> None:
    async with rig(tiny_model_dir, capacities={"A": 1, "B": 1}) as r, httpx.AsyncClient(timeout=30) as client:
        a, b = r.replicas["A"].fake, r.replicas["B"].fake
        await wait_for(lambda: r.client_of("B").connected, 5)
        first = await r.open_streams(client, 1)  # on A (a tie, round robin from A)
        second = await r.open_streams(client, 1)  # on B (fewer sequences)
        assert len(a.running) == len(b.running) == 1
        refused = await client.post(f"{r.url}/v1/completions", json=r.unary_body(5))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert len(a.refused) == len(b.refused) == 1  # refused by one, moved, refused by the other

        for task in first:
            task.cancel()
        await asyncio.gather(*first, return_exceptions=True)
        await wait_for(lambda: not a.running, 2)
        # A has room again; make it look busier, so the next request is placed on B, which is full.
        client_a = r.client_of("A")
        client_a.full_until = r.client_of("B").full_until = 0.0
        client_a.num_sequences += 5
        try:
            moved = await r.stream(client, 5)
        finally:
            client_a.num_sequences -= 5
        assert moved.complete and served_by(moved) == "A", moved
        assert len(b.refused) == 2 and len(a.refused) == 1  # B refused it, A ran it
        assert r.client_of("B").full  # and B is passed over for a second
        for task in second:
            task.cancel()
        await asyncio.gather(*second, return_exceptions=True)


async def test_a_batch_is_checked_against_the_rooms_the_replicas_have_now(tiny_model_dir: Path) -> None:
    """The completions batch check: the replicas' waiting rooms together (GetLoad max_waiting),
    a replica that is down counted with its last room (the batch fits once it is back: a 429 to
    retry meanwhile), and a room asked again after a replica restarts (its flag may have changed)."""
    async with rig(tiny_model_dir, capacities={"A": 2, "B": 2}) as r, httpx.AsyncClient(timeout=30) as client:
        b = r.replicas["B"]
        await wait_for(lambda: r.client_of("B").connected, 5)

        async def batch(num_prompts: int, **fields: object) -> httpx.Response:
            return await client.post(f"{r.url}/v1/completions",
                                     json={**r.unary_body(2), "prompt": [[1, 2]] * num_prompts, **fields})

        assert (await batch(4)).status_code == 200
        too_big = await batch(5)
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "prompt", too_big.text
        assert "at most 4 per request" in too_big.json()["error"]["message"]
        # Refused before any prompt is tokenized (200,000 texts were, 4.3 s of the event loop).
        tokenizer = r.pipeline.tokenizer
        encoded: list[int] = []
        encode_texts = tokenizer.encode_texts
        tokenizer.encode_texts = lambda texts, *args: encoded.append(len(texts)) or encode_texts(texts, *args)
        try:
            assert (await batch(5, prompt=["one", "two"] * 2 + ["three"])).status_code == 400
            assert encoded == []
            texts = await batch(3, prompt=["one", "two", "three"])
            assert texts.status_code == 200 and encoded == [3], texts.text  # one call for the batch
        finally:
            del tokenizer.encode_texts

        await b.stop()
        await wait_for(lambda: not r.client_of("B").connected, 5)
        # B is expected back: not a 400 telling the client to split its batch, but the retryable
        # 429 of the one replica that is up; past both rooms, still the 400.
        assert (await batch(3)).status_code == 429
        assert (await batch(5)).status_code == 400

        b.fake = FakeModelWorker(b.fake.info, TOKEN_OF["B"], capacity=10)  # back with a bigger room
        await b.start()
        await wait_for(lambda: r.client_of("B").connected, RECOVER_LIMIT_S)
        r.client_of("A").full_until = r.client_of("B").full_until = 0.0
        fits = await batch(12)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 12, fits.text


async def test_ready_needs_one_model_replica_and_one_detok_replica(tiny_model_dir: Path) -> None:
    async with rig(tiny_model_dir, num_detok=2) as r, httpx.AsyncClient(timeout=30) as client:
        a, b = r.replicas["A"], r.replicas["B"]
        await wait_for(lambda: r.client_of("B").connected, 5)
        assert (await client.get(f"{r.url}/ready")).status_code == 200
        await r.detok_servers[0].stop(None)
        await wait_for(lambda: not r.pipeline.detoks[0].connected, 2)
        ready = await client.get(f"{r.url}/ready")
        assert ready.status_code == 200 and len(ready.json()["detok_workers"]) == 1
        assert ready.json()["down"] == [f"detok worker {r.pipeline.detoks[0].address} (stream down)"]
        await a.stop()
        await b.stop()
        await wait_for(lambda: not r.pipeline.model_workers.any_connected, 2)
        ready = await client.get(f"{r.url}/ready")
        message = ready.json()["error"]["message"]
        assert ready.status_code == 503 and "no model worker replica" in message
        assert a.address in message and b.address in message and "detok worker" in message
        refused = await client.post(f"{r.url}/v1/completions", json=r.unary_body(5))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "workers_unavailable"
        await b.start()
        await wait_for(lambda: r.client_of("B").connected, RECOVER_LIMIT_S)
        ready = await client.get(f"{r.url}/ready")
        assert ready.status_code == 200 and ready.json()["model_workers"] == [b.address]



async def test_the_gateway_serves_while_a_listed_detok_replica_is_down(tiny_model_dir: Path) -> None:
    # It used to wait for every listed detok replica and exit at the startup timeout.
    async with rig(tiny_model_dir, num_detok_down=1) as r, httpx.AsyncClient(timeout=30) as client:
        (down,) = r.detok_down
        ready = await client.get(f"{r.url}/ready")
        assert ready.status_code == 200 and ready.json()["down"] == [f"detok worker {down} (stream down)"]
        assert (await r.stream(client, 5)).complete
        late = await start_server(down, lambda s: detok_worker_pb2_grpc.add_DetokenizerServicer_to_server(
            DetokenizerServicer(), s))
        try:
            await wait_for(lambda: r.pipeline.detoks[1].connected, RECOVER_LIMIT_S)
            ready = await client.get(f"{r.url}/ready")
            assert ready.status_code == 200 and len(ready.json()["detok_workers"]) == 2
        finally:
            await late.stop(None)


async def test_a_dns_name_is_one_replica_per_address_as_pods_come_and_go(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dns: list[str] = []  # what DNS_ENTRY resolves to now

    async def lookup(host: str, port: int) -> list[str]:
        assert (host, port) == ("model-workers.test", 50051)
        if not dns:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return sorted(dns)

    monkeypatch.setattr(replica_set, "resolve", lookup)
    async with rig(tiny_model_dir, dns=dns) as r, httpx.AsyncClient(timeout=30) as client:
        a, b = r.replicas["A"], r.replicas["B"]
        pool = r.pipeline.model_workers
        assert [x.address for x in pool.replicas] == [a.address]
        dns.append(b.address)  # a pod joins
        await wait_for(lambda: b.address in [x.address for x in pool.replicas] and r.client_of("B").connected, 3)
        running = await r.open_streams(client, 2)
        assert len(a.fake.adds) == len(b.fake.adds) == 1
        dns.remove(a.address)  # A leaves (scaled down, or draining) while its request runs
        client_a = r.client_of("A")
        await wait_for(lambda: client_a not in pool.live, 2)
        news = await asyncio.gather(*(r.stream(client, 5) for _ in range(3)))
        assert all(res.complete and served_by(res) == "B" for res in news), news
        assert len(a.fake.running) == 1  # not cut: it runs to its end on A
        dns.clear()  # a failed lookup drops nobody
        await asyncio.sleep(0.2)
        assert client_a in pool.replicas and r.client_of("B") in pool.live
        dns.append(b.address)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        # With its last request gone, A is let go; /ready no longer mentions it.
        await wait_for(lambda: client_a not in pool.replicas, 2)
        ready = (await client.get(f"{r.url}/ready")).json()
        assert ready["model_workers"] == [b.address] and ready["down"] == []



async def test_a_detok_dns_name_is_one_stream_per_address_as_pods_come_and_go(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # gRPC's own resolver put each stream on one address picked at start: a replica added later
    # got no sequences until a stream reconnected, and 2 streams over 2 replicas shared one half the time.
    detok_dns: list[str] = []  # what DETOK_DNS_ENTRY resolves to now

    async def lookup(host: str, port: int) -> list[str]:
        assert (host, port) == ("detok-workers.test", 50052)
        if not detok_dns:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return sorted(detok_dns)

    monkeypatch.setattr(replica_set, "resolve", lookup)
    async with rig(tiny_model_dir, num_detok=2, detok_dns=detok_dns) as r, httpx.AsyncClient(timeout=30) as client:
        first, second = r.detok_addresses
        pool = r.pipeline.detok_pool
        assert [d.address for d in pool.replicas] == [first]
        on_first = await r.open_streams(client, 1)
        detok_dns.append(second)  # a pod joins: it gets a stream of its own, and the next sequences
        await wait_for(lambda: [d.connected for d in pool.replicas] == [True, True], 5)
        client_first, client_second = pool.replicas
        on_second = await r.open_streams(client, 1)
        assert [req.detok for req in r.pipeline._live.values()] == [client_first, client_second]
        detok_dns.remove(first)  # the first leaves while its sequence runs: no new ones go there
        await wait_for(lambda: client_first not in pool.live, 2)
        news = await asyncio.gather(*(r.stream(client, 5) for _ in range(3)))
        assert all(res.complete and served_by(res) and len(res.text) == 5 for res in news), news
        ready = (await client.get(f"{r.url}/ready")).json()
        assert ready["detok_workers"] == [second] and ready["down"] == []
        detok_dns.clear()  # a failed lookup drops nobody
        await asyncio.sleep(0.2)
        assert pool.replicas == [client_first, client_second] and pool.live == [client_second]
        detok_dns.append(second)
        # The sequence left on the retired replica streams on there to its end.
        (rid,) = [rid for rid, req in r.pipeline._live.items() if req.detok is client_first]
        for replica in r.replicas.values():
            if rid in replica.fake.running:
                replica.fake.running[rid][1] = 0  # ends at its next step
        (kept,) = await asyncio.wait_for(asyncio.gather(*on_first), 10)
        assert kept.complete and served_by(kept) and kept.completion_tokens == len(kept.text) > 5
        await wait_for(lambda: pool.replicas == [client_second], 2)  # let go once its sequence ended
        for task in on_second:
            task.cancel()
        await asyncio.gather(*on_second, return_exceptions=True)


async def test_a_detok_replica_leaving_dns_is_let_go_after_its_render_calls_end(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Echo's RenderTokens come after a request's sequences ended: a replica with none open was
    # closed under the call, and the request failed with a bare 500 (review 99).
    detok_dns: list[str] = []

    async def lookup(host: str, port: int) -> list[str]:
        return sorted(detok_dns)

    real_render = DetokenizerServicer.RenderTokens
    rendering = asyncio.Event()

    async def slow_render(self, request, context):
        if slow:  # not the warm-ups
            rendering.set()
            await asyncio.sleep(0.5)
        return await real_render(self, request, context)

    slow = False
    monkeypatch.setattr(replica_set, "resolve", lookup)
    monkeypatch.setattr(DetokenizerServicer, "RenderTokens", slow_render)  # before the servers bind it
    async with rig(tiny_model_dir, num_detok=2, detok_dns=detok_dns) as r:
        pool = r.pipeline.detok_pool
        detok_dns[:] = r.detok_addresses
        await wait_for(lambda: len(pool.replicas) == 2 and all(d.connected for d in pool.replicas), 5)
        slow = True
        render = asyncio.create_task(r.pipeline._render_tokens([28120, 905]))
        await asyncio.wait_for(rendering.wait(), 5)
        (busy,) = [d for d in pool.replicas if d.num_renders]
        detok_dns.remove(busy.address)
        await wait_for(lambda: busy not in pool.live, 2)
        await asyncio.sleep(0.2)  # refreshes every 0.05 s: it stays while the call runs
        assert busy in pool.replicas
        rendered = await asyncio.wait_for(render, 5)
        assert len(rendered.text) == 2
        await wait_for(lambda: busy not in pool.replicas, 2)


async def test_a_replica_two_dns_names_list_stays_while_either_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # It was retired when the name it joined from dropped it, though the other listed it, then
    # closed and added again as a new connection (review 99).
    from gateway.replica_set import ReplicaSet

    @dataclass(eq=False)
    class Client:
        address: str

    names = {"a.test": [], "b.test": ["10.0.0.1:5"]}

    async def lookup(host: str, port: int) -> list[str]:
        return sorted(names[host])

    async def close(replica: Client) -> None:
        closed.append(replica.address)

    monkeypatch.setattr(replica_set, "resolve", lookup)
    closed: list[str] = []
    replicas = ReplicaSet("detok worker", ["dns:///a.test:5", "dns:///b.test:5", "10.0.0.2:5"], 60,
                          lambda address, _tls_name: Client(address), lambda _r: None, lambda _r: True, close)
    await replicas.resolve_all()
    assert [r.address for r in replicas.replicas] == ["10.0.0.2:5", "10.0.0.1:5"]
    first = replicas.replicas[1]
    names["a.test"], names["b.test"] = ["10.0.0.1:5", "10.0.0.2:5"], []
    await replicas.resolve_all()
    assert replicas.replicas == [replicas.replicas[0], first] and not replicas.retired
    names["a.test"] = []  # no name lists 10.0.0.1 now; 10.0.0.2 stays, listed as an address of its own
    await replicas.resolve_all()
    assert [r.address for r in replicas.live] == ["10.0.0.2:5"] and replicas.retired == {first}
    await replicas.close()
    assert sorted(closed) == ["10.0.0.1:5", "10.0.0.2:5"]


async def test_a_detok_dns_name_listed_once_per_stream_as_before_is_one_entry(caplog) -> None:
    # Deployments made before the gateway resolved names listed the name once per stream wanted.
    from gateway.detok_pool import DetokPool

    name, plain = "dns:///detok-workers.test:50052", "127.0.0.1:9"
    pool = DetokPool(Config(detok_workers=[name, plain, name, plain, name]), lambda *_: None, lambda *_: None)
    try:
        assert pool._set.entries == [name, plain, plain]  # a plain address listed twice: two streams, as before
        assert [d.address for d in pool.replicas] == [plain, plain]
        assert "lists a dns:/// name more than once" in caplog.text
    finally:
        await pool.close()


async def test_dns_entries_parse_and_resolve_to_grpc_targets() -> None:
    assert dns_name("dns:///model-workers.test:50051") == ("model-workers.test", 50051)
    assert dns_name("10.0.0.5:50051") is None
    for bad in ("dns://8.8.8.8/name:50051", "dns:///name", "dns:///:50051"):
        with pytest.raises(ValueError, match="dns:///HOST:PORT"):
            Config(model_workers=[bad])
    with pytest.raises(ValueError, match="at least one"):
        Config(model_workers=[])
    with pytest.raises(ValueError, match="twice"):
        Config(model_workers=["a:1", "a:1"])
    # Detok entries too, and addresses without a usable port: each waited out --startup-timeout-s.
    for flag, bad in (("detok_workers", "dns:foo"), ("detok_workers", "localhost"),
                      ("detok_workers", "127.0.0.1:99999"), ("model_workers", "10.0.0.5:0")):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')}: '{bad}'"):
            Config(**{flag: [bad]})
    assert Config(detok_workers=["[::1]:50052", "unix:/tmp/detok.sock", "dns:///detok:50052"]).detok_workers
    assert "127.0.0.1:50051" in await replica_set.resolve("localhost", 50051)


@pytest.mark.slow
async def test_kill_9_of_one_of_two_real_model_workers(tiny_model_dir: Path) -> None:
    """The same with the real processes (tokenwire.stack, tiny model): kill -9 one of two model
    workers mid-stream, then bring it back."""
    with start_stack(["--model", str(tiny_model_dir), "--load-format", "dummy", "--max-num-seqs", "8",
                      "--max-model-len", "1024", "--device", "cpu", "--num-threads", "1"],
                     num_model_workers=2, gateway_args=["--log-level", "warning"], timeout_s=180) as stack:
        killed = [s for s in stack.services if s.name == "model_worker"][0]
        killed_address, survivor_address = stack.model_worker_addresses
        url = f"{stack.gateway_url}/v1/completions"
        model = httpx.get(f"{stack.gateway_url}/v1/models", timeout=10).json()["data"][0]["id"]
        # The stack is up once one replica is; on a busy machine the second may connect later.
        deadline = time.monotonic() + 60
        while httpx.get(f"{stack.gateway_url}/ready", timeout=5).json().get("down") != []:
            assert time.monotonic() < deadline, "the gateway never had both model workers connected"
            time.sleep(0.05)

        def body(max_tokens: int) -> dict:
            return {"model": model, "prompt": [1, 4093, 198], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        def num_running(address: str) -> int:
            with grpc.insecure_channel(address) as channel:
                return model_worker_pb2_grpc.ModelWorkerStub(channel).GetLoad(
                    model_worker_pb2.GetLoadRequest(), timeout=5).num_running

        async with httpx.AsyncClient(timeout=60) as client:
            # One short request per replica first: a worker's first steps (oneDNN building its
            # kernels) can take seconds on a busy machine, long enough for the other replica to
            # finish all 600 tokens of its streams before this one has sent its first.
            warm = await asyncio.gather(*(stream_completion(client, url, body(4)) for _ in range(2)))
            assert all(res.complete for res in warm), warm
            started = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(stream_completion(client, url, body(600), first_chunk=e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            # Each replica runs the 3 placed on it (allowing a busy machine a moment to admit them).
            deadline = time.monotonic() + 20
            while (loads := (num_running(killed_address), num_running(survivor_address))) != (3, 3):
                if time.monotonic() > deadline or any(task.done() for task in tasks):
                    break
                await asyncio.sleep(0.1)
            if loads != (3, 3):
                for task in tasks:
                    task.cancel()
                done = await asyncio.gather(*tasks, return_exceptions=True)
                raise AssertionError(f"running per replica {loads}; streams: {done}")
            killed_at = time.monotonic()
            killed.kill()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            failed = [res for res in results if res.error is not None]
            completed = [res for res in results if res.complete]
            assert len(failed) == len(completed) == 3, results
            assert all(res.error["message"].startswith("lost the model worker stream (") and res.num_done == 1
                       for res in failed)
            assert all(res.completion_tokens == 600 for res in completed)
            time_to_error = max(res.ended_at for res in failed) - killed_at
            assert time_to_error < ABORT_LIMIT_S
            ready = httpx.get(f"{stack.gateway_url}/ready", timeout=5)
            assert ready.status_code == 200 and ready.json()["model_workers"] == [survivor_address]
            news = await asyncio.gather(*(stream_completion(client, url, body(16)) for _ in range(4)))
            assert all(res.complete for res in news), news

            respawned_at = time.monotonic()
            killed.respawn()
            wait_grpc_serving(killed, killed_address, 120)
            serving_s = time.monotonic() - respawned_at
            while httpx.get(f"{stack.gateway_url}/ready", timeout=5).json()["down"]:
                assert time.monotonic() - respawned_at < serving_s + RECOVER_LIMIT_S
                await asyncio.sleep(0.05)
            recover_s = time.monotonic() - respawned_at - serving_s
            started = [asyncio.Event() for _ in range(2)]
            tasks = [asyncio.create_task(stream_completion(client, url, body(300), first_chunk=e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            assert num_running(killed_address) == num_running(survivor_address) == 1
            assert all(res.complete for res in await asyncio.gather(*tasks))
    print(f"\n[figure] kill -9 of 1 of 2 real model workers: its 3 streams ended with an error event in "
          f"{time_to_error * 1000:.0f} ms, the other 3 completed 600 tokens; restart to serving {serving_s:.2f}s, "
          f"serving to the gateway using it again {recover_s:.2f}s")
