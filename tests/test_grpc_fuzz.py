"""Abusive gRPC messages to both workers, as real processes on loopback: hypothesis builds frames
mixing valid requests with out-of-vocab ids, empty prompts, huge and negative values, unknown and
duplicate ids; every bad one must be refused with INVALID_ARGUMENT (the request's own error in
the multiplexed stream, or the stream's status), every good one must run, and no worker may die.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.packing import pack_int32
from tokenwire.stack import ServiceProcess, free_port, spawn, wait_grpc_serving
from tokenwire.tokenizer_files import tokenizer_identity
from tokenwire.v1 import (
    common_pb2,
    detok_worker_pb2,
    detok_worker_pb2_grpc,
    model_worker_pb2,
    model_worker_pb2_grpc,
)

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@dataclass
class Worker:
    process: ServiceProcess
    address: str
    channel: grpc.Channel

    def assert_alive_and_serving(self) -> None:
        assert self.process.process.poll() is None, f"{self.process.name} died"
        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def start_worker(name: str, args: list[str]) -> Iterator[Worker]:
    port = free_port()
    process = spawn(name, name, ["--port", str(port), "--drain-grace-s", "1", *args])
    address = f"127.0.0.1:{port}"
    try:
        wait_grpc_serving(process, address, 120)
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            yield Worker(process, address, channel)
    finally:
        process.stop()
    assert process.process.returncode == 0, f"{name} exited with {process.process.returncode}"


@pytest.fixture(scope="module")
def model_worker(tiny_model_dir: Path) -> Iterator[Worker]:
    yield from start_worker("model_worker", [
        "--model", str(tiny_model_dir), "--load-format", "dummy", "--device", "cpu", "--max-num-seqs", "8",
        "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1"])


@pytest.fixture(scope="module")
def detok_worker() -> Iterator[Worker]:
    yield from start_worker("detok_worker", [])


@pytest.fixture(scope="module")
def vocab_size(model_worker: Worker) -> int:
    stub = model_worker_pb2_grpc.ModelWorkerStub(model_worker.channel)
    return stub.GetModelInfo(model_worker_pb2.GetModelInfoRequest(), timeout=10).vocab_size


# ---- the model worker ----

@dataclass
class FuzzAdd:
    add: model_worker_pb2.AddRequest
    abusive: list[str]  # why it must be refused; empty: it must run


@st.composite
def fuzz_adds(draw: st.DrawFn, vocab_size: int) -> FuzzAdd:
    abusive: list[str] = []
    prompt = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=8))
    prompt_kind = draw(st.sampled_from(["ok", "ok", "empty", "out_of_vocab", "negative_id", "too_long"]))
    if prompt_kind == "empty":
        prompt = []
    elif prompt_kind == "out_of_vocab":
        prompt[draw(st.integers(0, len(prompt) - 1))] = draw(st.integers(vocab_size, 2**31 - 1))
    elif prompt_kind == "negative_id":
        prompt[draw(st.integers(0, len(prompt) - 1))] = draw(st.integers(-(2**31), -1))
    elif prompt_kind == "too_long":
        prompt = prompt[:1] * MAX_MODEL_LEN
    if prompt_kind != "ok":
        abusive.append(f"prompt {prompt_kind}")
    max_tokens = draw(st.one_of(st.integers(1, 6), st.integers(-(2**31), -1), st.just(2**31 - 1)))
    if max_tokens < 0 or max_tokens > MAX_MODEL_LEN:
        abusive.append(f"max_tokens {max_tokens}")
    temperature = draw(st.one_of(st.sampled_from([0.0, 0.8]), st.floats(max_value=-1e-3, allow_infinity=True),
                                 st.just(math.nan)))
    if not temperature >= 0:
        abusive.append(f"temperature {temperature}")
    top_p = draw(st.one_of(st.sampled_from([0.0, 0.9, 1.0]), st.floats(1.001, 1e30), st.floats(-1e30, -1e-3)))
    if not 0 <= top_p <= 1:
        abusive.append(f"top_p {top_p}")
    top_k = draw(st.one_of(st.sampled_from([0, 5]), st.integers(-(2**31), -1)))
    if top_k < 0:
        abusive.append(f"top_k {top_k}")
    top_logprobs = draw(st.one_of(st.integers(0, 5), st.integers(-(2**31), -1), st.integers(vocab_size + 1, 2**31 - 1)))
    if not 0 <= top_logprobs <= vocab_size:
        abusive.append(f"top_logprobs {top_logprobs}")
    stop_ids = draw(st.one_of(st.just([]), st.lists(st.integers(0, vocab_size - 1), max_size=3),
                              st.lists(st.integers(vocab_size, 2**31 - 1), min_size=1, max_size=2)))
    if any(s >= vocab_size for s in stop_ids):
        abusive.append(f"stop_token_ids {stop_ids}")
    # Values in float32 range only: proto floats hold what the client sent after rounding.
    add = model_worker_pb2.AddRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
        stop_token_ids=stop_ids, logprobs=True, top_logprobs=top_logprobs,
        sampling=model_worker_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=7))
    return FuzzAdd(add, abusive)


def generate(worker: Worker, frames: list[model_worker_pb2.RequestFrame]) -> dict[str, list]:
    """Sends the frames, half-closes, and returns every request id's SequenceTokens in order."""
    stub = model_worker_pb2_grpc.ModelWorkerStub(worker.channel)
    replies: dict[str, list] = {}
    for frame in stub.Generate(iter(frames), timeout=60):
        for seq in frame.sequences:
            replies.setdefault(seq.request_id, []).append(seq)
    return replies


def terminal(seqs: list) -> model_worker_pb2.SequenceTokens:
    finished = [s for s in seqs if s.finish_reason != model_worker_pb2.FINISH_REASON_UNSPECIFIED]
    assert len(finished) == 1, f"want exactly one final SequenceTokens, got {len(finished)}"
    assert seqs[-1] is finished[0], "tokens after the final SequenceTokens"
    return finished[0]


def test_model_worker_refuses_every_abusive_add_and_runs_the_rest(model_worker: Worker, vocab_size: int) -> None:
    @FUZZ
    @given(st.lists(fuzz_adds(vocab_size), min_size=1, max_size=6))
    def check(adds: list[FuzzAdd]) -> None:
        replies = generate(model_worker, [model_worker_pb2.RequestFrame(adds=[a.add for a in adds])])
        assert set(replies) == {a.add.request_id for a in adds}
        for fuzz in adds:
            last = terminal(replies[fuzz.add.request_id])
            if fuzz.abusive:
                assert last.finish_reason == model_worker_pb2.FINISH_REASON_ERROR, fuzz.abusive
                assert last.error.code == INVALID, (fuzz.abusive, last.error)
                assert last.error.message
            elif last.finish_reason == model_worker_pb2.FINISH_REASON_STOP:  # drew one of its stop ids
                assert last.stop_token_id in fuzz.add.stop_token_ids, last
            else:
                assert last.finish_reason == model_worker_pb2.FINISH_REASON_LENGTH, last
                assert last.num_output_tokens == fuzz.add.max_tokens

    check()
    model_worker.assert_alive_and_serving()


def test_model_worker_duplicate_empty_and_unknown_ids(model_worker: Worker) -> None:
    def add(request_id: str) -> model_worker_pb2.AddRequest:
        return model_worker_pb2.AddRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=5,
                                           ignore_eos=True)

    replies = generate(model_worker, [
        model_worker_pb2.RequestFrame(adds=[add("dup"), add("dup"), add("")],
                                      aborts=[model_worker_pb2.AbortRequest(request_id="never-added"),
                                              model_worker_pb2.AbortRequest(request_id="")]),
        # Aborting an unknown id again, and adding "dup" a third time while the first still runs.
        model_worker_pb2.RequestFrame(adds=[add("dup")],
                                      aborts=[model_worker_pb2.AbortRequest(request_id="never-added")]),
    ])
    assert set(replies) == {"dup", ""}
    ends = [s for s in replies["dup"] if s.finish_reason != model_worker_pb2.FINISH_REASON_UNSPECIFIED]
    # The second "dup" arrives while the first is live (same frame): both end, in one error frame;
    # no token of the first comes after it. The third may arrive while that end is still on its
    # way (then it is refused with its own error frame) or after (then it runs to its length).
    assert ends[0].finish_reason == model_worker_pb2.FINISH_REASON_ERROR, ends
    assert ends[0].error.code == INVALID and "added again while live" in ends[0].error.message
    assert [e.finish_reason for e in ends[1:]] in ([model_worker_pb2.FINISH_REASON_ERROR],
                                                   [model_worker_pb2.FINISH_REASON_LENGTH]), ends
    after_error = replies["dup"][replies["dup"].index(ends[0]) + 1:]
    runs = [e for e in ends[1:] if e.finish_reason == model_worker_pb2.FINISH_REASON_LENGTH]
    assert sum(len(s.token_ids) for s in after_error) == 4 * 5 * len(runs), after_error
    assert terminal(replies[""]).error.code == INVALID
    model_worker.assert_alive_and_serving()


GARBAGE = b"\x0a\xff\xff\xff\xff\x0f not a protobuf"  # a length prefix far past the end


def send_garbage(worker: Worker, method: str) -> grpc.RpcError:
    raw = worker.channel.stream_stream(method)  # no serializers: bytes in, bytes out
    with pytest.raises(grpc.RpcError) as refused:
        list(raw(iter([GARBAGE]), timeout=10))
    worker.assert_alive_and_serving()
    return refused.value


def test_model_worker_refuses_bytes_that_are_not_a_request_frame(model_worker: Worker) -> None:
    error = send_garbage(model_worker, "/tokenwire.v1.ModelWorker/Generate")
    assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL), error


def test_detok_worker_refuses_bytes_that_are_not_a_detokenize_frame(detok_worker: Worker) -> None:
    error = send_garbage(detok_worker, "/tokenwire.v1.Detokenizer/Detokenize")
    assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL), error


# ---- the detok worker ----

@dataclass
class FuzzSequence:
    open_: detok_worker_pb2.OpenSequence | None  # None: tokens for a sequence never opened
    tokens: detok_worker_pb2.SequenceTokenIds
    abusive: list[str]


@st.composite
def fuzz_sequences(draw: st.DrawFn, identity: common_pb2.TokenizerIdentity, vocab_size: int) -> FuzzSequence:
    sequence_id = uuid.uuid4().hex
    abusive: list[str] = []
    ids = draw(st.lists(st.integers(0, vocab_size - 1), max_size=12))
    kind = draw(st.sampled_from(["ok", "ok", "ok", "out_of_vocab", "negative_id", "odd_bytes", "unknown_sequence",
                                 "bad_tokenizer"]))
    token_bytes = pack_int32(ids)
    tokenizer = identity
    if kind == "out_of_vocab":
        token_bytes = pack_int32([*ids, draw(st.integers(vocab_size, 2**31 - 1))])
    elif kind == "negative_id":
        token_bytes = pack_int32([draw(st.integers(-(2**31), -1)), *ids])
    elif kind == "odd_bytes":
        token_bytes += b"\x01" * draw(st.integers(1, 3))
    elif kind == "bad_tokenizer":
        tokenizer = common_pb2.TokenizerIdentity(path="/nonexistent/tokenizer", sha256="0" * 64)
    if kind != "ok":
        abusive.append(kind)
    stops = draw(st.lists(st.text(min_size=1, max_size=20), max_size=8))
    open_ = None if kind == "unknown_sequence" else detok_worker_pb2.OpenSequence(
        sequence_id=sequence_id, tokenizer=tokenizer, stop=stops,
        prompt_tail_ids=draw(st.lists(st.integers(0, vocab_size - 1), max_size=4)))
    tokens = detok_worker_pb2.SequenceTokenIds(sequence_id=sequence_id, token_ids=token_bytes, finished=True)
    return FuzzSequence(open_, tokens, abusive)


def detokenize(worker: Worker, frames: list[detok_worker_pb2.DetokenizeFrame]) -> dict[str, list]:
    stub = detok_worker_pb2_grpc.DetokenizerStub(worker.channel)
    deltas: dict[str, list] = {}
    for reply in stub.Detokenize(iter(frames), timeout=60):
        for delta in reply.deltas:
            deltas.setdefault(delta.sequence_id, []).append(delta)
    return deltas


def test_detok_worker_fails_each_abusive_sequence_alone(detok_worker: Worker, tiny_model_dir: Path,
                                                        vocab_size: int) -> None:
    identity = tokenizer_identity(tiny_model_dir)

    @FUZZ
    @given(st.lists(fuzz_sequences(identity, vocab_size), min_size=1, max_size=6))
    def check(sequences: list[FuzzSequence]) -> None:
        frame = detok_worker_pb2.DetokenizeFrame(opens=[s.open_ for s in sequences if s.open_ is not None],
                                                 tokens=[s.tokens for s in sequences])
        deltas = detokenize(detok_worker, [frame])
        for fuzz in sequences:
            mine = deltas.get(fuzz.tokens.sequence_id, [])
            assert mine and mine[-1].finished, f"{fuzz.abusive}: no final delta"
            assert sum(d.finished for d in mine) == 1
            if fuzz.abusive:
                assert mine[-1].error, fuzz.abusive
            else:
                assert not any(d.error for d in mine), [d.error for d in mine]

    check()
    detok_worker.assert_alive_and_serving()


@pytest.mark.parametrize("frame", [
    detok_worker_pb2.DetokenizeFrame(opens=[detok_worker_pb2.OpenSequence(sequence_id="")]),
    detok_worker_pb2.DetokenizeFrame(tokens=[detok_worker_pb2.SequenceTokenIds(sequence_id="", token_ids=b"")]),
    detok_worker_pb2.DetokenizeFrame(closes=[detok_worker_pb2.CloseSequence(sequence_id="")]),
], ids=["open", "tokens", "close"])
def test_detok_worker_refuses_a_frame_without_sequence_id(detok_worker: Worker, frame) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        detokenize(detok_worker, [frame])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details()
    detok_worker.assert_alive_and_serving()


def test_detok_worker_duplicate_open_and_unknown_close(detok_worker: Worker, tiny_model_dir: Path) -> None:
    identity = tokenizer_identity(tiny_model_dir)
    open_ = detok_worker_pb2.OpenSequence(sequence_id="twice", tokenizer=identity)
    deltas = detokenize(detok_worker, [
        detok_worker_pb2.DetokenizeFrame(opens=[open_], closes=[detok_worker_pb2.CloseSequence(sequence_id="ghost")]),
        detok_worker_pb2.DetokenizeFrame(opens=[open_]),
    ])
    (delta,) = deltas["twice"]
    assert delta.finished and "already open" in delta.error
    assert "ghost" not in deltas
    detok_worker.assert_alive_and_serving()
