"""bench/serving_path.py and its stand-in model worker: the stand-in's Generate contract (one token
per running request per step, in one frame; max_tokens; aborts), and the whole bench through the
real gateway and detok worker."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from bench.stand_in_model_worker import next_plain_id, plain_ids_of, stand_in, tokenizer_of
from tokenwire import grpc_server
from tokenwire.packing import unpack_int32
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc as pb_grpc


def test_the_walk_stays_on_plain_ids_and_reaches_them_all(smollm2_dir):
    tokenizer = tokenizer_of(smollm2_dir)
    plain = plain_ids_of(tokenizer)
    added = set(tokenizer.get_added_tokens_decoder())
    assert added and not added & set(plain)  # SmolLM2's specials (<|im_start|>, ...) are left out
    assert len(plain) + len(added) == tokenizer.get_vocab_size(with_added_tokens=True)
    few = [5, 9, 200, 201, 777]
    walk, seen = 7, set()
    for _ in range(500):
        token_id, walk = next_plain_id(walk, few)
        seen.add(token_id)
    assert seen == set(few)


async def _serve(servicer):
    server = grpc_server.new_server()
    pb_grpc.add_ModelWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_stand_in_steps_every_running_request_in_one_frame(smollm2_dir):
    servicer = stand_in(smollm2_dir, step_s=0.01)
    info = servicer.info
    server, address = await _serve(servicer)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.ModelWorkerStub(channel)
            assert (await stub.GetModelInfo(pb.GetModelInfoRequest())).tokenizer.sha256 == info.tokenizer.sha256
            call = stub.Generate()
            await call.write(pb.RequestFrame(adds=[
                pb.AddRequest(request_id="a", prompt_token_ids=[1, 2, 3], max_tokens=3),
                pb.AddRequest(request_id="b", prompt_token_ids=[4], max_tokens=50),
                pb.AddRequest(request_id="n2", prompt_token_ids=[4], max_tokens=5, n=2)]))
            frames = [await asyncio.wait_for(call.read(), 5) for _ in range(4)]
            await call.write(pb.RequestFrame(aborts=[pb.AbortRequest(request_id="b")]))
            last = None
            while last is None or not any(s.finish_reason == pb.FINISH_REASON_ABORT for s in last.sequences):
                last = await asyncio.wait_for(call.read(), 5)
            await call.done_writing()
            call.cancel()
    finally:
        await server.stop(None)
    (refusal,) = [s for s in frames[0].sequences if s.request_id == "n2"]
    assert refusal.finish_reason == pb.FINISH_REASON_ERROR
    assert refusal.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "n > 1" in refusal.error.message
    # Steps 1-3 carry one token of both requests; "a" ends at its max_tokens, "b" goes on alone.
    for step, frame in enumerate(frames[:3], start=1):
        by_id = {s.request_id: s for s in frame.sequences if s.request_id != "n2"}
        assert sorted(by_id) == ["a", "b"]
        for seq in by_id.values():
            (token_id,) = unpack_int32(seq.token_ids).tolist()
            assert token_id in servicer.plain_ids
            assert seq.num_output_tokens == step
        assert by_id["a"].num_prompt_tokens == 3 and by_id["b"].num_prompt_tokens == 1
        assert by_id["a"].finish_reason == (pb.FINISH_REASON_LENGTH if step == 3 else pb.FINISH_REASON_UNSPECIFIED)
    assert [s.request_id for s in frames[3].sequences] == ["b"]
    assert [s.request_id for s in last.sequences if s.finish_reason == pb.FINISH_REASON_ABORT] == ["b"]


async def test_stand_in_stream_interval_and_half_close(smollm2_dir):
    """Its --stream-interval (or a request's own) sends a request's tokens every N steps; closing
    the client side aborts nothing: the stream ends after its requests' last frames."""
    server, address = await _serve(stand_in(smollm2_dir, 0.005, 2))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.ModelWorkerStub(channel).Generate()
            await call.write(pb.RequestFrame(adds=[
                pb.AddRequest(request_id="a", prompt_token_ids=[1], max_tokens=5),
                pb.AddRequest(request_id="b", prompt_token_ids=[1], max_tokens=3, stream_interval=1)]))
            await call.done_writing()
            frames = [frame async for frame in call]
            assert await call.code() == grpc.StatusCode.OK
    finally:
        await server.stop(None)
    by_id: dict[str, list] = {"a": [], "b": []}
    for frame in frames:
        for seq in frame.sequences:
            by_id[seq.request_id].append(seq)
    a, b = by_id["a"], by_id["b"]
    assert [len(unpack_int32(s.token_ids)) for s in a] == [2, 2, 1]  # the last one at max_tokens
    assert [s.num_output_tokens for s in a] == [2, 4, 5]
    assert [s.finish_reason for s in a] == [0, 0, pb.FINISH_REASON_LENGTH]
    assert [s.num_output_tokens for s in b] == [1, 2, 3] and b[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.slow
def test_serving_path_bench_through_the_real_gateway_and_detok_worker(smollm2_dir, tmp_path):
    from bench.serving_path import main

    out = tmp_path / "serving_path.json"
    assert main(["--concurrency", "4", "--output-tokens", "25", "--waves", "2", "--step-ms", "5",
                 "--model", str(smollm2_dir), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert report["step_ms"] == 5
    assert run["concurrency"] == 4 and run["output_tokens"] == 200
    # One token per request per 5 ms step at most: 4 streams cannot exceed 800 tok/s.
    assert 0 < run["tokens_per_s"] <= 4 * 200 * 1.05
    # Every process works on every token, read in ns over the requests alone: none reads as idle.
    for process in ("gateway_us", "detok_worker_us", "stand_in_model_worker_us", "load_generator_us"):
        assert run[process] > 0, process
