"""The model worker as a real process on loopback: multiplexed Generate, errors, health, reflection.

Runs on the tiny random-weight model (SmolLM2 tokenizer), so it is fast and CPU-only.
"""

from __future__ import annotations

import queue

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import tiny_model_worker
from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.packing import unpack_float32, unpack_int32_list
from tokenwire.v1 import common_pb2, model_worker_pb2_grpc
from tokenwire.v1 import model_worker_pb2 as pb

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def worker_address(tiny_model_dir):
    with tiny_model_worker(tiny_model_dir, "--max-num-seqs", "4", "--max-model-len", str(MAX_MODEL_LEN),
                           "--max-num-batched-tokens", "64") as address:
        yield address


@pytest.fixture
def stub(worker_address):
    with grpc.insecure_channel(worker_address, options=CHANNEL_OPTIONS) as channel:
        yield model_worker_pb2_grpc.ModelWorkerStub(channel)


def add(request_id: str, prompt: list[int], max_tokens: int = 8, **kwargs) -> pb.AddRequest:
    sampling = kwargs.pop("sampling", pb.SamplingParams())
    return pb.AddRequest(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens,
                         sampling=sampling, ignore_eos=kwargs.pop("ignore_eos", True), **kwargs)


def run_stream(stub, frames: list[pb.RequestFrame]) -> dict[str, dict]:
    """Sends frames, closes, and collects every request's tokens and final SequenceTokens."""
    results: dict[str, dict] = {}
    num_frames = 0
    for frame in stub.Generate(iter(frames), timeout=60):
        num_frames += 1
        for seq in frame.sequences:
            r = results.setdefault(seq.request_id, {"tokens": [], "logprobs": [], "top": [], "last": None,
                                                    "finishes": []})
            r["tokens"] += unpack_int32_list(seq.token_ids)
            r["logprobs"] += unpack_float32(seq.logprobs).tolist()
            r["top"] += unpack_int32_list(seq.top_token_ids)
            if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                r["finishes"].append(seq.finish_reason)
                r["last"] = seq
    return results


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size == 49152
    assert info.max_model_len == MAX_MODEL_LEN
    assert list(info.eos_token_ids) == [2]
    assert "<|im_start|>" in info.chat_template
    assert len(info.tokenizer.sha256) == 64 and info.tokenizer.path


def test_multiplexed_requests_finish_with_length_and_counts(stub):
    prompts = {f"r{i}": list(range(10, 10 + 3 * i + 1)) for i in range(6)}  # 6 > 4 slots: some wait
    frame = pb.RequestFrame(adds=[add(rid, p, max_tokens=5 + i) for i, (rid, p) in enumerate(prompts.items())])
    results = run_stream(stub, [frame])
    assert set(results) == set(prompts)
    for i, (rid, prompt) in enumerate(prompts.items()):
        last = results[rid]["last"]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(results[rid]["tokens"]) == 5 + i == last.num_output_tokens
        assert last.num_prompt_tokens == len(prompt)


def test_greedy_is_deterministic_and_independent_of_batch(stub):
    prompt = [5, 6, 7, 8, 9]
    alone = run_stream(stub, [pb.RequestFrame(adds=[add("a", prompt, 12)])])["a"]["tokens"]
    others = [add(f"o{i}", list(range(100 + i, 120 + 2 * i)), 12) for i in range(3)]
    batched = run_stream(stub, [pb.RequestFrame(adds=[*others, add("a", prompt, 12)])])["a"]["tokens"]
    assert alone == batched and len(alone) == 12


def test_seeded_sampling_is_reproducible_amid_other_requests(stub):
    sampling = pb.SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    first = run_stream(stub, [pb.RequestFrame(adds=[add("s", [1, 2, 3], 16, sampling=sampling)])])["s"]["tokens"]
    others = [add(f"u{i}", [9, 9, 9, i], 16, sampling=pb.SamplingParams(temperature=1.0)) for i in range(3)]
    second = run_stream(stub, [pb.RequestFrame(adds=[*others, add("s", [1, 2, 3], 16, sampling=sampling)])])
    assert first == second["s"]["tokens"]


def test_logprobs_are_packed_per_token(stub):
    results = run_stream(stub, [pb.RequestFrame(adds=[add("l", [1, 2, 3], 6, logprobs=True, top_logprobs=3)])])
    assert results["l"]["finishes"] == [pb.FINISH_REASON_LENGTH]
    r = results["l"]
    assert len(r["logprobs"]) == 6 and all(lp <= 0.0 for lp in r["logprobs"])
    assert len(r["top"]) == 6 * 3
    # Greedy: the chosen token is the most likely one.
    assert [r["top"][3 * i] for i in range(6)] == r["tokens"]


def test_stop_token_ends_with_stop(stub):
    prompt = [5, 6, 7, 8, 9]
    greedy = run_stream(stub, [pb.RequestFrame(adds=[add("g", prompt, 10)])])["g"]["tokens"]
    stop_at = greedy[3]
    results = run_stream(stub, [pb.RequestFrame(adds=[add("g", prompt, 10, stop_token_ids=[stop_at])])])
    last = results["g"]["last"]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_token_id == stop_at
    assert results["g"]["tokens"] == greedy[:greedy.index(stop_at) + 1]


@pytest.mark.parametrize("bad_add, message", [
    (add("e", []), "empty"),
    (add("e", [1, 49152]), "outside the vocabulary"),
    (add("e", [1] * MAX_MODEL_LEN), "context"),
    (add("e", [1, 2], max_tokens=MAX_MODEL_LEN), "maximum context length"),
    (add("e", [1, 2], sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (add("e", [1, 2], sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    (add("e", [1, 2], max_tokens=-3), "max_tokens"),
    (add("e", [1, 2], sampling=pb.SamplingParams(allowed_token_ids=[7, 9], bad_words=[
        common_pb2.TokenIdSequence(token_ids=ids) for ids in ([9], [7], [3, 8])])),
     "no token is left to sample"),
    (add("e", [1, 2], cache_salt="s" * 1025), "cache_salt must be at most 1024 characters"),
])
def test_bad_requests_fail_alone_with_invalid_argument(stub, bad_add, message):
    results = run_stream(stub, [pb.RequestFrame(adds=[bad_add, add("ok", [1, 2, 3], 3)])])
    err = results["e"]["last"]
    assert err.finish_reason == pb.FINISH_REASON_ERROR
    assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert message in err.error.message
    assert results["ok"]["last"].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("bad_add, field, message", [
    (add("e", []), "prompt_token_ids", "empty"),
    (add("e", [1, 49152]), "prompt_token_ids", "outside the vocabulary"),
    (add("e", [1, 2], stop_token_ids=[-3]), "stop_token_ids", "outside the vocabulary"),
    (add("e", [1, 2], max_tokens=-3), "max_tokens", "max_tokens"),
    (add("e", [1, 2], max_tokens=MAX_MODEL_LEN), "max_tokens", "maximum context length"),
    # A vocabulary's worth a token passed gRPC's 64 MiB message limit and ended the whole stream.
    (add("e", [1, 2], logprobs=True, top_logprobs=21), "top_logprobs", "--max-logprobs"),
    (add("e", [1, 2], prompt_logprobs=49152), "prompt_logprobs", "--max-logprobs"),
    # Alternatives without logprobs were dropped without a word (the proto says they need it).
    (add("e", [1, 2], top_logprobs=3), "top_logprobs", "needs logprobs"),
    (add("e", [1, 2], top_logprobs=-5), "top_logprobs", "must be in [0, 20]"),
    (add("", [1, 2]), "request_id", "request_id is empty"),
])
def test_refusals_name_the_field_at_fault(stub, bad_add, field, message):
    results = run_stream(stub, [pb.RequestFrame(adds=[bad_add, add("ok", [1, 2, 3], 3)])])
    err = results[bad_add.request_id]["last"]
    assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert err.error.field == field and message in err.error.message, err.error
    assert results["ok"]["last"].finish_reason == pb.FINISH_REASON_LENGTH


def test_duplicate_request_id_is_refused(stub):
    results = run_stream(stub, [pb.RequestFrame(adds=[add("d", [1, 2], 50), add("d", [3, 4], 5)])])
    # Frames name requests by id alone: the duplicate ends the live request too, and the id's one
    # last frame is the error (no tokens of the first after it).
    assert results["d"]["finishes"] == [pb.FINISH_REASON_ERROR]
    assert results["d"]["last"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert len(results["d"]["tokens"]) < 50


def test_abort_ends_request_with_abort_and_frees_slot(stub):
    def frames():
        yield pb.RequestFrame(adds=[add("long", [1, 2, 3], MAX_MODEL_LEN - 10)])
        yield pb.RequestFrame(aborts=[pb.AbortRequest(request_id="long")])
    results = run_stream(stub, list(frames()))
    last = results["long"]["last"]
    assert last.finish_reason == pb.FINISH_REASON_ABORT
    assert len(results["long"]["tokens"]) < MAX_MODEL_LEN - 10
    # Its last frame counts what it made, as every frame does (abort outputs carried 0).
    assert last.num_output_tokens == len(results["long"]["tokens"]) and last.num_prompt_tokens == 3
    # All 4 slots usable afterwards: 4 concurrent requests all finish.
    again = run_stream(stub, [pb.RequestFrame(adds=[add(f"x{i}", [1, 2], 4) for i in range(4)])])
    assert all(r["last"].finish_reason == pb.FINISH_REASON_LENGTH for r in again.values())


def finals_by_index(results: dict, request_id: str, frames: list[pb.RequestFrame], stub) -> list[tuple[int, int]]:
    finals = []
    for frame in stub.Generate(iter(frames), timeout=60):
        finals += [(s.index, s.finish_reason) for s in frame.sequences
                   if s.request_id == request_id and s.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    return sorted(finals)


@pytest.mark.parametrize("kind", ["beam search", "best_of", "n", "compiling a grammar"])
def test_an_aborted_request_ends_each_of_its_outputs(stub, kind):
    """The proto's rule: each index ends with its own finish_reason. Beam search and a request
    aborted while its grammar compiled ended index 0 alone."""
    options = {"beam search": {"best_of": 3, "use_beam_search": True},
               "best_of": {"best_of": 3, "sampling": pb.SamplingParams(temperature=1.0, seed=3)},
               "n": {"sampling": pb.SamplingParams(temperature=1.0, seed=3)},
               "compiling a grammar": {"sampling": pb.SamplingParams(temperature=1.0, seed=3),
                                       "structured_output": pb.StructuredOutput(regex="[ab]{1,30}")}}[kind]
    request = add("x", [1, 2, 3, 4, 5], 200, n=2, **options)
    frames = [pb.RequestFrame(adds=[request], aborts=[pb.AbortRequest(request_id="x")])]
    assert finals_by_index({}, "x", frames, stub) == [(0, pb.FINISH_REASON_ABORT), (1, pb.FINISH_REASON_ABORT)]


def test_a_grammar_no_allowed_token_can_follow_ends_with_its_error(stub):
    # allowed_token_ids holds only "x", which the regex never allows.
    request = add("g", [1, 2, 3], 20, sampling=pb.SamplingParams(allowed_token_ids=[104]),
                  structured_output=pb.StructuredOutput(regex="[ab]+"))
    last = run_stream(stub, [pb.RequestFrame(adds=[request])])["g"]["last"]
    assert last.finish_reason == pb.FINISH_REASON_ERROR
    assert last.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "grammar" in last.error.message


def test_cached_prompt_tokens_on_beam_outputs_and_abort_frames(stub):
    prompt = list(range(200, 250))
    run_stream(stub, [pb.RequestFrame(adds=[add("warm", prompt, 2)])])
    beams = [s for frame in stub.Generate(iter([pb.RequestFrame(adds=[add("b", prompt, 4, n=2, best_of=2,
                                                                          use_beam_search=True)])]), timeout=60)
             for s in frame.sequences]
    assert beams and all(s.num_cached_prompt_tokens >= 32 for s in beams), [s.num_cached_prompt_tokens for s in beams]
    # Aborted once it has run (an abort that overtakes its admission finds nothing cached yet).
    frames: queue.Queue = queue.Queue()
    frames.put(pb.RequestFrame(adds=[add("c", prompt, MAX_MODEL_LEN - 60)]))
    call = stub.Generate(iter(frames.get, None), timeout=60)
    first = next(call).sequences[0]
    frames.put(pb.RequestFrame(aborts=[pb.AbortRequest(request_id="c")]))
    frames.put(None)
    aborted = [s for frame in call for s in frame.sequences][-1]
    assert first.num_cached_prompt_tokens >= 32
    assert aborted.finish_reason == pb.FINISH_REASON_ABORT
    assert aborted.num_cached_prompt_tokens == first.num_cached_prompt_tokens


def test_health_and_reflection(worker_address):
    with grpc.insecure_channel(worker_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
            service="tokenwire.v1.ModelWorker"), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "tokenwire.v1.ModelWorker" in names and "grpc.health.v1.Health" in names
