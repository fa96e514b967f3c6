"""The detok worker as a real process on a loopback port: health, reflection, Detokenize.

Starts `python -m detok_worker`, waits for grpc health SERVING, drives one multiplexed
stream the way the gateway does, and kills the process at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokenizers import Tokenizer

from tokenwire.packing import pack_int32
from tokenwire.tokenizer_files import tokenizer_identity
from tokenwire.v1 import common_pb2, detok_worker_pb2_grpc
from tokenwire.v1 import detok_worker_pb2 as pb

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICE = "tokenwire.v1.Detokenizer"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_detok_worker(log_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """A detok worker process on a free port, SERVING; its address."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "detok_worker", "--host", "127.0.0.1", "--port", str(port), *flags],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
    try:
        wait_serving(process, address, log_path)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, address


def wait_serving(process: subprocess.Popen, address: str, log_path: Path) -> None:
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            assert process.poll() is None, f"detok worker exited:\n{log_path.read_text()}"
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"detok worker not SERVING:\n{log_path.read_text()}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def detok_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("detok") / "detok.log"
    process, address = start_detok_worker(log_path)
    try:
        assert address in log_path.read_text(), "the listening address is logged"
        yield address
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_reflection_lists_the_detokenizer(detok_address: str) -> None:
    with grpc.insecure_channel(detok_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(responses).list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


async def test_multiplexed_stream(detok_address: str, smollm2_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    identity = tokenizer_identity(smollm2_dir)
    texts = {
        "plain": "Streaming text, one frame at a time. ✨",
        "stop": "Answer: 42.\n\nQuestion: what else? Observation: nothing",
        "emoji": "Emoji 🇯🇵🍣 and 漢字 mixed in. <|im_end|>",
    }
    ids = {name: tokenizer.encode(text).ids for name, text in texts.items()}
    async with grpc.aio.insecure_channel(detok_address) as channel:
        call = detok_worker_pb2_grpc.DetokenizerStub(channel).Detokenize()

        async def exchange(frame: pb.DetokenizeFrame) -> dict[str, pb.TextDelta]:
            await call.write(frame)
            reply = await call.read()
            return {d.sequence_id: d for d in reply.deltas}

        opened = await exchange(pb.DetokenizeFrame(opens=[
            pb.OpenSequence(sequence_id="plain", tokenizer=identity, skip_special_tokens=True),
            pb.OpenSequence(sequence_id="stop", tokenizer=identity, stop=["Observation:", "\n\n"]),
            pb.OpenSequence(sequence_id="emoji", tokenizer=identity, skip_special_tokens=False),
            pb.OpenSequence(sequence_id="nowhere", tokenizer=common_pb2.TokenizerIdentity(path=str(tmp_path))),
        ]))
        assert list(opened) == ["nowhere"] and opened["nowhere"].finished and opened["nowhere"].error

        emitted = dict.fromkeys(texts, "")
        final: dict[str, pb.TextDelta] = {}
        for i in range(max(map(len, ids.values()))):
            entries = [
                pb.SequenceTokenIds(sequence_id=name, token_ids=pack_int32(seq_ids[i:i + 1]),
                                    finished=i == len(seq_ids) - 1)
                for name, seq_ids in ids.items() if i < len(seq_ids)
            ]
            for name, delta in (await exchange(pb.DetokenizeFrame(tokens=entries))).items():
                assert name not in final and not delta.error
                emitted[name] += delta.text
                if delta.finished:
                    final[name] = delta
        assert emitted == {"plain": texts["plain"], "stop": "Answer: 42.", "emoji": texts["emoji"]}
        assert (final["stop"].stop_index, final["plain"].stop_index) == (1, -1)
        stop_count = final["stop"].num_tokens_to_stop
        assert "\n\n" in tokenizer.decode(ids["stop"][:stop_count])
        assert "\n\n" not in tokenizer.decode(ids["stop"][:stop_count - 1])

        errors = await exchange(pb.DetokenizeFrame(
            opens=[pb.OpenSequence(sequence_id="late", tokenizer=identity)],
            tokens=[pb.SequenceTokenIds(sequence_id="ghost", token_ids=pack_int32([1])),
                    pb.SequenceTokenIds(sequence_id="late", token_ids=pack_int32([5, 10**6]))],
        ))
        assert "no open sequence" in errors["ghost"].error
        assert "1000000" in errors["late"].error and errors["late"].finished

        # A frame that no per-sequence answer covers ends the stream.
        await call.write(pb.DetokenizeFrame(opens=[pb.OpenSequence(sequence_id="")]))
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await call.read()
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_render_tokens_rpc(detok_address: str, smollm2_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    identity = tokenizer_identity(smollm2_dir)
    ids = tokenizer.encode(" naïve 🙂🍣").ids
    async with grpc.aio.insecure_channel(detok_address) as channel:
        stub = detok_worker_pb2_grpc.DetokenizerStub(channel)
        rendered = await stub.RenderTokens(pb.RenderTokensRequest(tokenizer=identity, token_ids=pack_int32(ids)))
        offsets = list(memoryview(rendered.offsets).cast("i"))
        assert len(rendered.text) == len(ids) and len(offsets) == len(ids) + 1
        assert rendered.data == " naïve 🙂🍣".encode() and offsets[-1] == len(rendered.data)
        assert any(text.startswith("bytes:\\x") for text in rendered.text)  # 🍣 spans tokens
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.RenderTokens(pb.RenderTokensRequest(tokenizer=identity, token_ids=pack_int32([10**6])))
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1000000" in failure.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.RenderTokens(pb.RenderTokensRequest(
                tokenizer=common_pb2.TokenizerIdentity(path=str(tmp_path)), token_ids=pack_int32([1])))
        assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_sigterm_waits_for_open_sequences_then_exits_without_the_whole_grace(
        smollm2_dir: Path, tmp_path: Path) -> None:
    # The gateway's stream stays open for good, so only "no open sequence" can end the drain
    # early (the grace is 30 s here; it used to run to its end every time).
    process, address = start_detok_worker(tmp_path / "detok.log", "--drain-grace-s", "30")
    identity = tokenizer_identity(smollm2_dir)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = detok_worker_pb2_grpc.DetokenizerStub(channel).Detokenize()
            await call.write(pb.DetokenizeFrame(
                opens=[pb.OpenSequence(sequence_id="open", tokenizer=identity)],
                tokens=[pb.SequenceTokenIds(sequence_id="open", token_ids=pack_int32([1, 2]))]))
            await call.read()
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(1.0)
            assert process.poll() is None, "it left with a sequence open"
            signalled = time.monotonic()
            await call.write(pb.DetokenizeFrame(
                tokens=[pb.SequenceTokenIds(sequence_id="open", token_ids=pack_int32([3]), finished=True)]))
            assert (await call.read()).deltas[0].finished
            process.wait(timeout=10)
            assert time.monotonic() - signalled < 5 and process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
