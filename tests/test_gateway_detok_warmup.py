"""The gateway warms each detok replica's tokenizer before its Detokenize stream opens.

A replica loads a tokenizer (and builds its tables) at the first sequence that names it: ~0.8 s
for SmolLM2, which a first request would otherwise wait for. A fake Detokenizer records what
reaches it in what order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from detok_worker.servicer import DetokenizerServicer
from detok_worker.token_table import decoding_with_tables, token_table_for
from gateway.config import Config
from gateway.detok_client import DetokClient
from tokenwire.packing import pack_int32, unpack_int32
from tokenwire.v1 import common_pb2, detok_worker_pb2, detok_worker_pb2_grpc

TOKENIZER = common_pb2.TokenizerIdentity(path="/models/m", sha256="ab" * 32)


class RecordingDetokenizer(detok_worker_pb2_grpc.DetokenizerServicer):
    def __init__(self, refuse_render: bool = False, hang_render: bool = False) -> None:
        self.calls: list[tuple[str, object]] = []
        self.refuse_render = refuse_render
        self.refuse_code = grpc.StatusCode.FAILED_PRECONDITION
        self.hang_render = hang_render

    async def RenderTokens(self, request, context):
        self.calls.append(("RenderTokens", request))
        if self.hang_render:
            await asyncio.sleep(60)
        if self.refuse_render:
            await context.abort(self.refuse_code, "cannot load tokenizer '/models/m'")
        return detok_worker_pb2.RenderedTokens()

    async def Detokenize(self, request_iterator: AsyncIterator, context):
        self.calls.append(("Detokenize", None))
        async for _frame in request_iterator:
            yield detok_worker_pb2.TextDeltaFrame()


async def _open_client(servicer: RecordingDetokenizer, tokenizer: common_pb2.TokenizerIdentity | None,
                       warmup_timeout_s: float = 10.0):
    server = grpc.aio.server()
    detok_worker_pb2_grpc.add_DetokenizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = DetokClient(f"127.0.0.1:{port}", channel, lambda client, frame: None, lambda client, error: None,
                         warmup_timeout_s)
    client.tokenizer = tokenizer
    await client.stream.start(10.0)
    for _ in range(100):  # the call is open on our side; wait until the server has seen it
        if any(name == "Detokenize" for name, _ in servicer.calls):
            break
        await asyncio.sleep(0.01)
    return server, channel, client


async def _close(server, channel, client) -> None:
    await client.stream.close()
    await channel.close()
    await server.stop(None)


async def test_the_tokenizer_is_warmed_before_the_stream_opens():
    servicer = RecordingDetokenizer()
    server, channel, client = await _open_client(servicer, TOKENIZER)
    try:
        assert [name for name, _ in servicer.calls] == ["RenderTokens", "Detokenize"]
        request = servicer.calls[0][1]
        assert request.tokenizer == TOKENIZER and unpack_int32(request.token_ids) == [0]
    finally:
        await _close(server, channel, client)


async def test_a_replica_that_cannot_load_the_tokenizer_is_refused_until_it_can(caplog):
    # Its sequences would all fail, and with the fewest open it would get every request: its stream
    # stays closed (the pipeline places nothing there), and it is asked again until it loads.
    servicer = RecordingDetokenizer(refuse_render=True)
    server = grpc.aio.server()
    detok_worker_pb2_grpc.add_DetokenizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = DetokClient(f"127.0.0.1:{port}", channel, lambda client, frame: None, lambda client, error: None)
    client.tokenizer = TOKENIZER
    client.refusal_recheck_s = 0.2
    try:
        client.stream.launch()
        for _ in range(200):
            if sum(name == "RenderTokens" for name, _ in servicer.calls) >= 2:
                break
            await asyncio.sleep(0.01)
        assert not client.connected and "Detokenize" not in [name for name, _ in servicer.calls]
        assert client.refusal == "cannot load the model's tokenizer: cannot load tokenizer '/models/m'"
        assert caplog.text.count("refused: cannot load the model's tokenizer") == 1  # once, not at every recheck
        servicer.refuse_code = grpc.StatusCode.INTERNAL  # another failure: the stream opens, the refusal ends
        await asyncio.wait_for(client.stream.wait_connected(), 5)
        assert client.refusal == ""
    finally:
        await _close(server, channel, client)


async def test_a_failed_warm_up_of_another_kind_still_opens_the_stream(caplog):
    servicer = RecordingDetokenizer(refuse_render=True)
    servicer.refuse_code = grpc.StatusCode.INTERNAL
    server, channel, client = await _open_client(servicer, TOKENIZER)
    try:
        assert client.stream.connected and client.refusal == ""
        assert [name for name, _ in servicer.calls] == ["RenderTokens", "Detokenize"]
        assert "warming tokenizer /models/m failed (INTERNAL" in caplog.text
    finally:
        await _close(server, channel, client)


async def test_a_hung_warm_up_delays_the_stream_only_by_its_timeout(caplog):
    servicer = RecordingDetokenizer(hang_render=True)
    began = time.monotonic()
    server, channel, client = await _open_client(servicer, TOKENIZER, warmup_timeout_s=0.3)
    try:
        assert client.stream.connected
        assert 0.3 <= time.monotonic() - began < 5
        assert "warming tokenizer /models/m failed (DEADLINE_EXCEEDED" in caplog.text
    finally:
        await _close(server, channel, client)


def test_the_warm_up_timeout_must_be_positive():
    with pytest.raises(ValueError, match="--detok-warmup-timeout-s"):
        Config(detok_warmup_timeout_s=0)


async def test_without_a_tokenizer_nothing_is_warmed():
    servicer = RecordingDetokenizer()
    server, channel, client = await _open_client(servicer, None)
    try:
        assert [name for name, _ in servicer.calls] == ["Detokenize"]
    finally:
        await _close(server, channel, client)


@pytest.mark.slow
def test_the_detok_worker_builds_the_column_tables_when_it_loads_a_tokenizer(smollm2_dir):
    from tokenwire.tokenizer_files import tokenizer_identity

    assert DetokenizerServicer()._open_decoding is decoding_with_tables
    token_table_for.cache_clear()
    decoding = decoding_with_tables(tokenizer_identity(smollm2_dir))
    assert decoding.token_bytes  # SmolLM2's is byte-level
    hits_before = token_table_for.cache_info().hits
    for token_bytes in decoding.token_bytes.values():
        token_table_for(token_bytes)
    assert token_table_for.cache_info().hits == hits_before + len(decoding.token_bytes)


class HangingDetokenizer(RecordingDetokenizer):
    """Answers frames until `hung`, then neither frames nor RenderTokens (its event loop blocked
    while its gRPC core still answers keepalive pings)."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = False

    async def RenderTokens(self, request, context):
        while self.hung:
            await asyncio.sleep(0.05)
        return await super().RenderTokens(request, context)

    async def Detokenize(self, request_iterator: AsyncIterator, context):
        self.calls.append(("Detokenize", None))
        async for _frame in request_iterator:
            while self.hung:
                await asyncio.sleep(0.05)
            yield detok_worker_pb2.TextDeltaFrame()


async def test_a_replica_that_stops_answering_frames_is_dropped_until_it_answers(caplog):
    servicer = HangingDetokenizer()
    server = grpc.aio.server()
    detok_worker_pb2_grpc.add_DetokenizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    lost: list[Exception] = []
    client = DetokClient(f"127.0.0.1:{port}", channel, lambda client, frame: None,
                         lambda client, error: lost.append(error), warmup_timeout_s=0.3)
    client.tokenizer = TOKENIZER
    client.stall_timeout_s, client.refusal_recheck_s = 0.5, 0.2
    try:
        await client.stream.start(10.0)
        opened = detok_worker_pb2.OpenSequence(sequence_id="s", tokenizer=TOKENIZER)
        client.send([opened], [])
        await asyncio.sleep(0.3)
        assert client.stream.connected and not lost  # answered
        servicer.hung = True
        client.send([], [detok_worker_pb2.SequenceTokenIds(sequence_id="s", token_ids=pack_int32([1]))])
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.05)
        assert [str(e) for e in lost] == ["the detok worker answered no frame for 0.5 s"]
        # Reconnecting, its warm-up times out too: refused while it stays hung, not given new sequences.
        for _ in range(100):
            if client.refusal:
                break
            await asyncio.sleep(0.05)
        assert client.refusal.startswith("hung") and not client.connected
        servicer.hung = False
        await asyncio.wait_for(client.stream.wait_connected(), 5)
        assert client.refusal == ""
    finally:
        servicer.hung = False
        await _close(server, channel, client)
