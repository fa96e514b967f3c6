"""bench/serving_path.py and its stand-in model worker: the stand-in's Generate contract (one token
per running request per step, in one frame; max_tokens; aborts), and the whole bench through the
real gateway and detok worker."""

from __future__ import annotations

import asyncio
import json

import grpc

from bench.stand_in_model_worker import FIRST_PLAIN_ID, StandInModelWorker, model_info, plain_token_id
from tokenwire import grpc_server
from tokenwire.packing import unpack_int32
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc as pb_grpc


def test_plain_token_ids_stay_in_the_vocabulary_past_the_special_ids():
    state, seen = 7, set()
    for _ in range(5000):
        token_id, state = plain_token_id(state, 300)
        assert FIRST_PLAIN_ID <= token_id < 300
        seen.add(token_id)
    assert len(seen) == 200  # the walk reaches every plain id of a small vocabulary


async def test_stand_in_steps_every_running_request_in_one_frame(smollm2_dir):
    info = model_info(smollm2_dir)
    server = grpc_server.new_server()
    pb_grpc.add_ModelWorkerServicer_to_server(StandInModelWorker(info, step_s=0.01), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
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
    assert refusal.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "n = 1" in refusal.error.message
    # Steps 1-3 carry one token of both requests; "a" ends at its max_tokens, "b" goes on alone.
    for step, frame in enumerate(frames[:3], start=1):
        by_id = {s.request_id: s for s in frame.sequences if s.request_id != "n2"}
        assert sorted(by_id) == ["a", "b"]
        for seq in by_id.values():
            (token_id,) = unpack_int32(seq.token_ids).tolist()
            assert FIRST_PLAIN_ID <= token_id < info.vocab_size
            assert seq.num_output_tokens == step
        assert by_id["a"].num_prompt_tokens == 3 and by_id["b"].num_prompt_tokens == 1
        assert by_id["a"].finish_reason == (pb.FINISH_REASON_LENGTH if step == 3 else pb.FINISH_REASON_UNSPECIFIED)
    assert [s.request_id for s in frames[3].sequences] == ["b"]
    assert [s.request_id for s in last.sequences if s.finish_reason == pb.FINISH_REASON_ABORT] == ["b"]


async def test_stand_in_stream_interval_sends_a_requests_tokens_every_n_steps(smollm2_dir):
    server = grpc_server.new_server()
    pb_grpc.add_ModelWorkerServicer_to_server(StandInModelWorker(model_info(smollm2_dir), 0.005, 2), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ModelWorkerStub(channel).Generate()
            await call.write(pb.RequestFrame(adds=[pb.AddRequest(request_id="a", prompt_token_ids=[1], max_tokens=5)]))
            frames = [await asyncio.wait_for(call.read(), 5) for _ in range(3)]
            call.cancel()
    finally:
        await server.stop(None)
    seqs = [frame.sequences[0] for frame in frames]
    assert [len(unpack_int32(s.token_ids)) for s in seqs] == [2, 2, 1]  # the last one at max_tokens
    assert [s.num_output_tokens for s in seqs] == [2, 4, 5]
    assert [s.finish_reason for s in seqs] == [0, 0, pb.FINISH_REASON_LENGTH]


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
    # The gateway's CPU comes from /proc in clock ticks (~25 ms of it here); the client's own
    # process time covers its requests only.
    assert run["gateway_us"] > 0 and run["load_generator_us"] > 0
