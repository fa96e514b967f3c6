"""The model worker process with the paged cache: n / best_of over the wire, GetLoad, and
ModelInfo's cache figures. Tiny random-weight model on loopback, CPU only."""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import tiny_model_worker
from tests.test_model_worker_service import add, run_stream
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

KV_TOKENS = 512
BLOCK = 8


@pytest.fixture(scope="module")
def stub(tiny_model_dir):
    with tiny_model_worker(tiny_model_dir, "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "128",
                           "--max-num-batched-tokens", "64", "--kv-cache-tokens", str(KV_TOKENS),
                           "--block-size", str(BLOCK), "--max-best-of", "4") as address, \
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        yield model_worker_pb2_grpc.ModelWorkerStub(channel)


def by_index(stub, frames: list[pb.RequestFrame], request_id: str) -> dict[int, dict]:
    """Every SequenceTokens of request_id, grouped by index."""
    from tokenwire.packing import unpack_int32_list

    per_index: dict[int, dict] = {}
    for frame in stub.Generate(iter(frames), timeout=60):
        for seq in frame.sequences:
            if seq.request_id != request_id:
                continue
            r = per_index.setdefault(seq.index, {"tokens": [], "finishes": [], "cached": seq.num_cached_prompt_tokens})
            r["tokens"] += unpack_int32_list(seq.token_ids)
            if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                r["finishes"].append(seq.finish_reason)
    return per_index


def test_model_info_reports_dtype_device_and_cache_tokens(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.dtype, info.device, info.kv_cache_tokens) == ("float32", "cpu", KV_TOKENS)


def test_n_streams_each_index_and_each_ends_on_its_own(stub):
    sampling = pb.SamplingParams(temperature=1.0, seed=5)
    results = by_index(stub, [pb.RequestFrame(adds=[add("n3", [1, 2, 3, 4, 5], 7, sampling=sampling, n=3)])], "n3")
    assert set(results) == {0, 1, 2}
    for r in results.values():
        assert len(r["tokens"]) == 7 and r["finishes"] == [pb.FINISH_REASON_LENGTH]


def test_best_of_sends_only_n_at_the_end(stub):
    sampling = pb.SamplingParams(temperature=1.0, seed=9)
    results = by_index(stub, [pb.RequestFrame(adds=[add("b", [9, 8, 7], 5, sampling=sampling, n=2, best_of=4)])],
                       "b")
    assert set(results) == {0, 1}
    assert all(len(r["tokens"]) == 5 and r["finishes"] == [pb.FINISH_REASON_LENGTH] for r in results.values())


def test_shared_prefix_is_served_from_the_cache(stub):
    prefix = list(range(500, 500 + 3 * BLOCK))
    run_stream(stub, [pb.RequestFrame(adds=[add("p1", prefix + [1], 2)])])
    results = by_index(stub, [pb.RequestFrame(adds=[add("p2", prefix + [2], 2)])], "p2")
    assert results[0]["cached"] == 3 * BLOCK
    load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.prefix_cache_hit_tokens >= 3 * BLOCK and load.prefix_cache_queried_tokens > load.prefix_cache_hit_tokens


def test_abort_ends_every_index_and_frees_the_blocks(stub):
    def frames():
        yield pb.RequestFrame(adds=[add("g", [1, 2, 3], 100, n=3)])
        yield pb.RequestFrame(aborts=[pb.AbortRequest(request_id="g")])
    results = by_index(stub, list(frames()), "g")
    assert set(results) == {0, 1, 2}
    assert all(r["finishes"] == [pb.FINISH_REASON_ABORT] for r in results.values())
    load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.kv_blocks_used == 0 and load.num_running == 0 and load.num_waiting == 0
    assert (load.kv_blocks_total, load.kv_block_size, load.max_waiting) == (KV_TOKENS // BLOCK, BLOCK, 1024)


def test_abort_of_one_output_ends_only_that_one(stub):
    """AbortRequest.indexes: one of n choices hit a stop string in the detok worker; it stops
    (ABORT, its blocks freed) while the request's other outputs run to their length."""
    import queue

    requests: queue.Queue = queue.Queue()
    requests.put(pb.RequestFrame(adds=[add("o", [1, 2, 3], 100, n=3)]))
    per_index: dict[int, dict] = {}
    aborted = False
    replies = stub.Generate(iter(requests.get, None), timeout=60)
    for frame in replies:
        for seq in frame.sequences:
            r = per_index.setdefault(seq.index, {"num_tokens": 0, "finishes": []})
            r["num_tokens"] += len(seq.token_ids) // 4
            if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                r["finishes"].append(seq.finish_reason)
        if not aborted and per_index.get(1, {}).get("num_tokens", 0) >= 2:
            aborted = True
            requests.put(pb.RequestFrame(aborts=[pb.AbortRequest(request_id="o", indexes=[1])]))
        if all(per_index.get(i, {}).get("finishes") for i in range(3)):
            break
    requests.put(None)
    replies.cancel()
    assert per_index[1]["finishes"] == [pb.FINISH_REASON_ABORT] and per_index[1]["num_tokens"] < 100
    for i in (0, 2):
        assert per_index[i] == {"num_tokens": 100, "finishes": [pb.FINISH_REASON_LENGTH]}
    load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.kv_blocks_used == 0 and load.num_running == 0


@pytest.mark.parametrize("n, best_of, message, field", [
    (-1, 0, "n must be >= 1", "n"),
    (3, 2, "best_of must be >= n", "best_of"),
    (2, 5, "must be <= 4", "best_of"),
])
def test_bad_n_or_best_of_is_invalid_argument(stub, n, best_of, message, field):
    results = run_stream(stub, [pb.RequestFrame(adds=[add("e", [1, 2], 3, n=n, best_of=best_of)])])
    err = results["e"]["last"]
    assert err.finish_reason == pb.FINISH_REASON_ERROR
    assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in err.error.message
    assert err.error.field == field
