"""Sampling over the wire (tiny model, real worker process): new params reach the sampler, bad
ones come back as INVALID_ARGUMENT, prompt and cumulative logprobs are packed in frames."""

from __future__ import annotations

import math

import grpc
import pytest

from tests.test_model_worker_service import add, run_stream, stub, worker_address  # noqa: F401 (fixtures)
from tokenwire.packing import unpack_float32, unpack_int32_list
from tokenwire.v1 import common_pb2
from tokenwire.v1 import model_worker_pb2 as pb


@pytest.mark.parametrize(("sampling", "message"), [
    (pb.SamplingParams(min_p=2.0), "min_p"),
    (pb.SamplingParams(temperature=1.0, mirostat=1), "mirostat"),
    (pb.SamplingParams(logit_bias={60000: 1.0}), "logit_bias"),
    (pb.SamplingParams(bad_words=[common_pb2.TokenIdSequence()]), "bad_words"),
    (pb.SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
    (pb.SamplingParams(sampler_order=7), "sampler_order"),
])
def test_bad_sampling_params_fail_alone_with_invalid_argument(stub, sampling, message):  # noqa: F811
    results = run_stream(stub, [pb.RequestFrame(adds=[add("e", [1, 2], sampling=sampling), add("ok", [1, 2, 3], 3)])])
    err = results["e"]["last"]
    assert err.finish_reason == pb.FINISH_REASON_ERROR
    assert err.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert message in err.error.message
    assert results["ok"]["last"].finish_reason == pb.FINISH_REASON_LENGTH


def test_prompt_and_cumulative_logprobs_come_in_frames(stub):  # noqa: F811
    prompt = [5, 6, 7, 8, 9, 10]
    sampling = pb.SamplingParams(temperature=0.8, top_k=20, seed=3, repetition_penalty=1.2, dry_multiplier=0.5)
    frames = []
    for frame in stub.Generate(iter([pb.RequestFrame(adds=[
            add("p", prompt, 5, sampling=sampling, logprobs=True, top_logprobs=2, prompt_logprobs=3)])]), timeout=60):
        frames.extend(s for s in frame.sequences if s.request_id == "p")
    with_prompt = [s for s in frames if s.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0] is frames[0]
    first = with_prompt[0]
    prompt_lps = unpack_float32(first.prompt_logprobs).tolist()
    assert len(prompt_lps) == len(prompt) and math.isnan(prompt_lps[0]) and all(lp < 0 for lp in prompt_lps[1:])
    assert first.num_prompt_top_logprobs == 3
    top_ids = unpack_int32_list(first.prompt_top_token_ids)
    assert len(top_ids) == 3 * len(prompt) and top_ids[:3] == [-1, -1, -1]
    logprobs = [lp for s in frames for lp in unpack_float32(s.logprobs).tolist()]
    assert len(logprobs) == 5
    assert math.isclose(frames[-1].cumulative_logprob, sum(logprobs), rel_tol=1e-4)
