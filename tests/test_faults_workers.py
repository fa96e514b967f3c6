"""Fault tests on the real processes (tokenwire.stack, tiny model, mTLS on every gRPC hop): kill -9
of the model worker and of one detok replica mid-stream, SIGTERM drains, client disconnects.

Each test prints its figures (time to abort, time to recover); run with -s to see them. The
tests share one stack and run in file order: each leaves it whole again, except the last, which
drains the gateway away.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from bench.soak import StreamResult, stream_completion
from tests.tls_certs import Certs, make_certs
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.grpc_tls import ClientTLS, client_tls, sync_channel
from tokenwire.stack import ServiceProcess, Stack, free_port, start_stack, wait_grpc_serving
from tokenwire.v1 import model_worker_pb2, model_worker_pb2_grpc

pytestmark = pytest.mark.slow

# A stream cut by a dead worker must end with its error event within this; measured ~ms on loopback.
ABORT_LIMIT_S = 5.0
# From a restarted worker serving again to the gateway ready: gRPC's reconnect backoff is capped
# at 5 s (tokenwire.grpc_server.CHANNEL_OPTIONS), plus the stream's own 0.5 s retry.
RECONNECT_LIMIT_S = 8.0
DRAIN_GRACE_S = 10.0
# keepalive: a ping every 10 s, 5 s for its ack (tokenwire.grpc_server.CHANNEL_OPTIONS).
HUNG_LIMIT_S = 16.0
DETOK_DRAIN_GRACE_S = 10.0
PROMPT = [1, 4093, 198, 19556]
LONG = 1000  # tokens: outlasts every kill below by seconds on the tiny model


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls(certs: Certs) -> ClientTLS:
    tls = client_tls(str(certs.ca), str(certs.client_cert), str(certs.client_key), "")
    assert tls is not None
    return tls


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, certs: Certs, tls: ClientTLS) -> Iterator[Stack]:
    server_tls = ["--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
                  "--tls-client-ca-file", str(certs.ca)]
    with start_stack(
            ["--model", str(tiny_model_dir), "--load-format", "dummy", "--max-num-seqs", "16",
             "--max-model-len", "1024", "--device", "cpu", "--num-threads", "1",
             "--drain-grace-s", str(DRAIN_GRACE_S), *server_tls],
            num_detok=2, detok_args=[*server_tls, "--drain-grace-s", str(DETOK_DRAIN_GRACE_S)],
            gateway_args=["--worker-tls-ca-file", str(certs.ca), "--worker-tls-cert-file", str(certs.client_cert),
                          "--worker-tls-key-file", str(certs.client_key), "--drain-grace-s", str(DRAIN_GRACE_S),
                          "--log-level", "warning"],
            tls=tls, timeout_s=180) as running:
        yield running


def service(stack: Stack, name: str, index: int = 0) -> ServiceProcess:
    return [s for s in stack.services if s.name == name][index]


def body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def unary_body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    return httpx.get(f"{stack.gateway_url}/v1/models", timeout=10).json()["data"][0]["id"]


async def open_streams(client: httpx.AsyncClient, stack: Stack, model: str, count: int,
                       max_tokens: int, base_url: str | None = None) -> list[asyncio.Task[StreamResult]]:
    """`count` streams (to the stack's gateway, or the one at base_url), returned once every one
    has its first output chunk."""
    started = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(stream_completion(client, f"{base_url or stack.gateway_url}/v1/completions",
                                                   body(model, max_tokens), first_chunk=event))
             for event in started]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
    return tasks


def readiness(stack: Stack, url: str | None = None) -> tuple[int, list[str]]:
    """The /ready status of the stack's gateway (or the one at url): 200 while at least one model
    worker and one detok replica take work, and the replicas it lists as down (in the body, or
    the 503's message)."""
    try:
        reply = httpx.get(f"{url or stack.gateway_url}/ready", timeout=5)
    except httpx.HTTPError:
        return 0, ["the gateway does not answer"]
    if reply.status_code == 200:
        return 200, reply.json()["down"]
    return reply.status_code, [reply.json()["error"]["message"]]


def ready_status(stack: Stack) -> int:
    return readiness(stack)[0]


def wait_gateway_ready(stack: Stack, timeout_s: float) -> float:
    """Seconds until the gateway's readiness says every worker stream is up again."""
    started = time.monotonic()
    while readiness(stack) != (200, []):
        assert time.monotonic() - started < timeout_s, f"gateway not ready {timeout_s:.0f}s after the restart"
        time.sleep(0.05)
    return time.monotonic() - started


async def wait_listed_down(stack: Stack, address: str, timeout_s: float = 2.0) -> int:
    """A draining worker turns NOT_SERVING; the gateway's health watch sees it within ms. Returns
    /ready's status then (503 when no replica of its kind is left)."""
    started = time.monotonic()
    while True:
        status, down = await asyncio.to_thread(readiness, stack)
        if any(address in reason for reason in down):
            return status
        assert time.monotonic() - started < timeout_s, f"the gateway does not list {address} as down"
        await asyncio.sleep(0.02)


async def one_completion(client: httpx.AsyncClient, stack: Stack, model: str, max_tokens: int = 8) -> StreamResult:
    return await stream_completion(client, f"{stack.gateway_url}/v1/completions", body(model, max_tokens))


async def test_client_disconnect_frees_the_worker_within_a_step(stack: Stack, model: str, tls: ClientTLS) -> None:
    with sync_channel(stack.model_worker_address, tls, CHANNEL_OPTIONS) as channel:
        stub = model_worker_pb2_grpc.ModelWorkerStub(channel)
        try:
            stub.GetLoad(model_worker_pb2.GetLoadRequest(), timeout=5)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                pytest.skip("the model worker does not implement GetLoad yet")
            raise
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = await open_streams(client, stack, model, 4, LONG)
            load = stub.GetLoad(model_worker_pb2.GetLoadRequest(), timeout=5)
            assert load.num_running == 4 and load.kv_blocks_used > 0
            left_at = time.monotonic()
            for task in tasks:
                task.cancel()  # closes each HTTP connection mid-stream
            await asyncio.gather(*tasks, return_exceptions=True)
        while True:
            load = stub.GetLoad(model_worker_pb2.GetLoadRequest(), timeout=5)
            if load.num_running == 0 and load.kv_blocks_used == 0:
                break
            assert time.monotonic() - left_at < 2.0, f"still running 2 s after the clients left: {load}"
            await asyncio.sleep(0.01)
    print(f"\n[figure] client disconnect -> model worker idle, KV freed: {time.monotonic() - left_at:.3f}s")


async def test_model_worker_kill_fails_every_stream_promptly_then_the_gateway_recovers(
        stack: Stack, model: str, tls: ClientTLS) -> None:
    worker = service(stack, "model_worker")
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = await open_streams(client, stack, model, 4, LONG)
        killed_at = time.monotonic()
        worker.kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks), ABORT_LIMIT_S + 5)
        for result in results:
            assert result.status == 200 and result.error is not None, result
            assert "model worker" in result.error["message"], result.error
            assert result.num_done == 1 and result.num_finish_chunks == 0
        time_to_abort = max(r.ended_at for r in results) - killed_at
        assert time_to_abort < ABORT_LIMIT_S
        assert ready_status(stack) == 503
        refused = await client.post(f"{stack.gateway_url}/v1/completions", json=unary_body(model, 4))
        assert refused.status_code == 503, refused.text

        respawned_at = time.monotonic()
        worker.respawn()
        wait_grpc_serving(worker, stack.model_worker_address, 120, tls)
        serving_at = time.monotonic()
        reconnect_s = wait_gateway_ready(stack, RECONNECT_LIMIT_S)
        after = await one_completion(client, stack, model)
        assert after.complete, after
    print(f"\n[figure] model worker kill -9: all 4 streams ended with an error event in {time_to_abort:.3f}s; "
          f"worker restart to serving {serving_at - respawned_at:.2f}s, serving to gateway ready "
          f"{reconnect_s:.2f}s, restart to first good completion {time.monotonic() - respawned_at:.2f}s")


async def test_hung_model_worker_is_noticed_by_keepalive_and_streams_fail(stack: Stack, model: str) -> None:
    """SIGSTOP: the socket stays open, so only the keepalive ping's missing ack (5 s,
    CHANNEL_OPTIONS) tells the gateway; streams must not hang until the client gives up."""
    worker = service(stack, "model_worker")
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = await open_streams(client, stack, model, 2, LONG)
        worker.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), HUNG_LIMIT_S + 5)
        finally:
            worker.process.send_signal(signal.SIGCONT)
        continued_at = time.monotonic()
        time_to_abort = max(r.ended_at for r in results) - stopped_at
        for result in results:
            assert result.error is not None and "model worker" in result.error["message"], result
        assert time_to_abort < HUNG_LIMIT_S
        reconnect_s = wait_gateway_ready(stack, RECONNECT_LIMIT_S)
        assert (await one_completion(client, stack, model)).complete
    print(f"\n[figure] model worker SIGSTOP: both streams ended with an error event {time_to_abort:.2f}s later; "
          f"after SIGCONT the gateway was ready in {reconnect_s:.2f}s "
          f"({time.monotonic() - continued_at:.2f}s to a good completion)")


async def test_detok_replica_kill_moves_its_streams_to_the_other_and_their_text_goes_on_whole(
        stack: Stack, model: str, tls: ClientTLS, tiny_model_dir: Path) -> None:
    """The gateway holds every id it sent a detok replica: a stream whose replica dies reopens on
    the other one with them, and its client reads on where it was (before, it failed with an error
    event although nothing of it was lost)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    replica = service(stack, "detok_worker", 0)
    async with httpx.AsyncClient(timeout=60) as client:
        started = [asyncio.Event() for _ in range(6)]
        tasks = [asyncio.create_task(stream_completion(
            client, f"{stack.gateway_url}/v1/completions", {**body(model, 400), "return_token_ids": True},
            first_chunk=event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        replica.kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(r.complete and r.completion_tokens == 400 for r in results), results
        for result in results:  # the text of exactly the ids generated: nothing lost, nothing twice
            assert len(result.token_ids) == 400
            assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
        # New sequences go to the live replica while the dead one is away; still ready on it.
        status, down = readiness(stack)
        assert status == 200 and down == [f"detok worker {stack.detok_addresses[0]} (stream down)"], down
        news = await asyncio.gather(*(one_completion(client, stack, model) for _ in range(4)))
        assert all(r.complete for r in news), news

        respawned_at = time.monotonic()
        replica.respawn()
        wait_grpc_serving(replica, stack.detok_addresses[0], 60, tls)
        serving_at = time.monotonic()
        reconnect_s = wait_gateway_ready(stack, RECONNECT_LIMIT_S)
        after = await asyncio.gather(*(one_completion(client, stack, model) for _ in range(4)))
        assert all(r.complete for r in after), after
    print(f"\n[figure] detok replica kill -9: all 6 streams completed with their whole text (those on it "
          f"reopened on the other); replica restart to serving {serving_at - respawned_at:.2f}s, "
          f"serving to gateway ready {reconnect_s:.2f}s")


async def test_model_worker_sigterm_drains_running_requests_then_exits(
        stack: Stack, model: str, tls: ClientTLS) -> None:
    worker = service(stack, "model_worker")
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = await open_streams(client, stack, model, 4, 200)
        signalled_at = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        # Draining: no new requests (503 at once), the running ones go on.
        assert await wait_listed_down(stack, stack.model_worker_address) == 503
        refused = await client.post(f"{stack.gateway_url}/v1/completions", json=unary_body(model, 4))
        assert refused.status_code == 503, refused.text
        results = await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_GRACE_S + 5)
        assert all(r.complete and r.completion_tokens == 200 for r in results), results
        await asyncio.to_thread(worker.process.wait, DRAIN_GRACE_S + 5)
        drain_s = time.monotonic() - signalled_at
        # Exits once its requests are done, not at the end of the grace period.
        assert drain_s < DRAIN_GRACE_S
        worker.respawn()
        wait_grpc_serving(worker, stack.model_worker_address, 120, tls)
        wait_gateway_ready(stack, RECONNECT_LIMIT_S)
        assert (await one_completion(client, stack, model)).complete
    print(f"\n[figure] model worker SIGTERM with 4 running streams: all completed, worker exited "
          f"{drain_s:.2f}s after the signal (grace {DRAIN_GRACE_S:.0f}s)")


async def test_detok_sigterm_finishes_its_sequences_and_new_ones_go_to_the_other_replica(
        stack: Stack, model: str, tls: ClientTLS) -> None:
    replica = service(stack, "detok_worker", 0)
    async with httpx.AsyncClient(timeout=60) as client:
        running = await open_streams(client, stack, model, 4, 100)  # on both replicas
        replica.process.send_signal(signal.SIGTERM)
        assert await wait_listed_down(stack, stack.detok_addresses[0]) == 200  # the other replica serves
        late = await open_streams(client, stack, model, 4, LONG)
        # The drain lets the sequences already on replica 0 finish...
        assert all(r.complete and r.completion_tokens == 100 for r in await asyncio.gather(*running))
        # ...and placed none of the late ones there: killing it now (still inside its grace)
        # would end those with an error.
        replica.kill()
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*late), 60)
        assert all(r.complete and r.completion_tokens == LONG for r in results), results
        assert max(r.ended_at for r in results) > killed_at, "the check needs streams outliving the replica"
        replica.respawn()
        wait_grpc_serving(replica, stack.detok_addresses[0], 60, tls)
        wait_gateway_ready(stack, RECONNECT_LIMIT_S)
    print("\n[figure] detok SIGTERM: its running sequences finished; the 4 opened during its drain all went "
          "to the other replica")


async def test_gateway_drain_ends_what_outlasts_its_grace_with_a_503_in_openai_shape(
        stack: Stack, model: str, certs: Certs, tmp_path: Path) -> None:
    """A second gateway on the same workers, with a short grace: uvicorn cancelled the requests
    still open at its end, so a stream stopped with no error event and no [DONE] and a plain
    request got a text/plain 500 (review 87). Now both get the 503 before it ends."""
    port, log = free_port(), tmp_path / "gateway.log"
    with log.open("w") as out:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--port", str(port), "--model-workers", stack.model_worker_address,
             "--detok-workers", ",".join(stack.detok_addresses), "--worker-tls-ca-file", str(certs.ca),
             "--worker-tls-cert-file", str(certs.client_cert), "--worker-tls-key-file", str(certs.client_key),
             # 0.4 s: its 503 comes 0.2 s in. With 1 s (0.5 s in) a 1000-token stream of the
             # tiny model on an idle host sometimes ended first (0.87 s, CI).
             "--drain-grace-s", "0.4"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(readiness, stack, url))[0] != 200:
            assert gateway.poll() is None and time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=60) as client:
            [streamed] = await open_streams(client, stack, model, 1, LONG, base_url=url)
            plain = asyncio.create_task(client.post(f"{url}/v1/completions", json=unary_body(model, LONG)))
            await asyncio.sleep(0.1)  # the plain request is running too
            signalled_at = time.monotonic()
            gateway.send_signal(signal.SIGTERM)
            result = await asyncio.wait_for(streamed, 10)
            reply = await asyncio.wait_for(plain, 10)
            ended_s = time.monotonic() - signalled_at
        code = await asyncio.to_thread(gateway.wait, 10)
    finally:
        gateway.kill()
        gateway.wait()
    assert result.status == 200 and result.num_done == 1 and result.text, result
    assert result.error is not None and result.error["code"] == "workers_unavailable", result
    assert "shutting down" in result.error["message"] and result.finish_reason is None, result
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "workers_unavailable", reply.text
    assert code == -signal.SIGTERM, log.read_text()  # uvicorn raises the signal it drained on again
    assert "2 request(s) still open" in log.read_text() and "Traceback" not in log.read_text(), log.read_text()
    print(f"\n[figure] gateway drain with a 0.4 s grace: a stream and a plain request still open got their 503 "
          f"{ended_s:.2f}s after SIGTERM")


async def test_gateway_sigterm_finishes_open_streams_and_refuses_new_ones(stack: Stack, model: str) -> None:
    """Last: the gateway does not come back."""
    gateway = service(stack, "gateway")
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = await open_streams(client, stack, model, 3, 200)
        signalled_at = time.monotonic()
        gateway.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(timeout=5) as fresh:
                await fresh.get(f"{stack.gateway_url}/health")
        results = await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_GRACE_S + 5)
        assert all(r.complete and r.completion_tokens == 200 for r in results), results
    await asyncio.to_thread(gateway.process.wait, DRAIN_GRACE_S + 5)
    print(f"\n[figure] gateway SIGTERM with 3 open streams: all completed, gateway exited "
          f"{time.monotonic() - signalled_at:.2f}s after the signal")
