"""AddRequest -> SamplingParams (the proto's defaults and "0 means off"), and the packing of
cumulative and prompt logprobs into SequenceTokens."""

from __future__ import annotations

import math

import grpc

from model_worker.engine import SequenceOutput
from model_worker.sampling.prompt_logprobs import PromptLogprobs
from model_worker.sequence import FinishReason, LogprobsMode, SamplerOrder
from model_worker.servicer import build_frame, sampling_from_proto
from tokenwire.packing import unpack_float32, unpack_int32_list
from tokenwire.v1 import common_pb2
from tokenwire.v1 import model_worker_pb2 as pb


def test_unset_fields_take_the_documented_defaults():
    p = sampling_from_proto(pb.AddRequest(request_id="a", sampling=pb.SamplingParams()))
    assert p.greedy and p.top_k == 0 and p.top_p == 1.0 and p.typical_p == 1.0
    assert p.repetition_penalty == 1.0 and p.repeat_penalty == 1.0
    assert p.penalty_last_n == 64
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, -1)
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta) == (0, 5.0, 0.1)
    assert p.seed is None and p.prompt_logprobs is None
    assert p.sampler_order == SamplerOrder.DEFAULT and p.logprobs_mode == LogprobsMode.RAW


def test_set_fields_are_carried_over():
    s = pb.SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, seed=0, min_p=0.05, typical_p=0.8, top_n_sigma=1.5,
        xtc_threshold=0.2, xtc_probability=0.5, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3,
        dry_penalty_last_n=128, dry_sequence_breakers=[common_pb2.TokenIdSequence(token_ids=[198])],
        mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.1, repeat_penalty=1.2, penalty_last_n=-1, logit_bias={5: -100.0, 3: 2.5},
        min_tokens=4, bad_words=[common_pb2.TokenIdSequence(token_ids=[7, 8])], allowed_token_ids=[1, 2, 3],
        sampler_order=pb.SAMPLER_ORDER_LLAMA_CPP)
    add = pb.AddRequest(request_id="a", sampling=s, logprobs=True, top_logprobs=4,
                        logprobs_mode=pb.LOGPROBS_MODE_PROCESSED, prompt_logprobs=0)
    p = sampling_from_proto(add)
    assert p.seed == 0  # set to 0 is a seed, not "unset"
    assert p.penalty_last_n == -1 and p.dry_penalty_last_n == 128 and p.dry_base == 2.0
    assert p.dry_sequence_breakers == ((198,),) and p.bad_words == ((7, 8),)
    assert p.logit_bias == ((3, 2.5), (5, -100.0)) and p.allowed_token_ids == (1, 2, 3)
    assert p.sampler_order == SamplerOrder.LLAMA_CPP and p.logprobs_mode == LogprobsMode.PROCESSED
    assert p.prompt_logprobs == 0 and p.top_logprobs == 4
    assert math.isclose(p.min_p, 0.05, rel_tol=1e-6) and p.mirostat == 2


def test_cumulative_and_prompt_logprobs_are_packed():
    prompt = PromptLogprobs(1)
    prompt.logprobs += [-1.5, -0.25]
    prompt.ranks += [4, 1]
    prompt.top_token_ids += [7, 8]
    prompt.top_logprobs += [-0.5, -0.25]
    first = SequenceOutput(seq_id=0, token_id=11, logprob=-0.5, raw_logprob=-0.5, cumulative_logprob=-0.5,
                           prompt_logprobs=prompt, num_prompt_tokens=3, num_output_tokens=1)
    second = SequenceOutput(seq_id=0, token_id=12, logprob=-1.0, raw_logprob=-1.0, cumulative_logprob=-1.5,
                            num_prompt_tokens=3, num_output_tokens=2)
    frame = build_frame([("r", first), ("r", second)])
    seq = frame.sequences[0]
    assert seq.cumulative_logprob == -1.5
    lps = unpack_float32(seq.prompt_logprobs).tolist()
    assert math.isnan(lps[0]) and lps[1:] == [-1.5, -0.25]
    assert seq.num_prompt_top_logprobs == 1
    assert unpack_int32_list(seq.prompt_top_token_ids) == [-1, 7, 8]
    assert unpack_int32_list(seq.prompt_ranks) == [0, 4, 1]
    later = build_frame([("r", second)]).sequences[0]
    assert later.prompt_logprobs == b"" and later.num_prompt_top_logprobs == 0
    # An abort's last frame, with no token of its own, still says the sum so far.
    aborted = SequenceOutput(seq_id=0, token_id=None, finish_reason=FinishReason.ABORT, cumulative_logprob=-204.5,
                             num_prompt_tokens=3, num_output_tokens=21)
    assert build_frame([("r", aborted)]).sequences[0].cumulative_logprob == -204.5


def test_a_frame_keeps_an_ended_requests_end_before_a_reused_ids_items():
    """A request id may be reused on a stream once its request has ended; the end and the new
    request's first tokens can share a frame. Failures went to the frame's end (after the new
    request's token), and a finished entry took the new request's tokens in: either way the client
    read the old request's end as the new one's."""
    from model_worker.engine_loop import RequestFailure

    failed = RequestFailure("dup", grpc.StatusCode.INVALID_ARGUMENT, "added again while live")
    new_token = SequenceOutput(seq_id=1, token_id=7, logprob=-0.5, num_prompt_tokens=3, num_output_tokens=1)
    frame = build_frame([("dup", SequenceOutput(seq_id=0, token_id=5, num_output_tokens=1)), failed, ("dup", new_token)])
    assert [(s.request_id, s.finish_reason, unpack_int32_list(s.token_ids)) for s in frame.sequences] == [
        ("dup", pb.FINISH_REASON_UNSPECIFIED, [5]), ("dup", pb.FINISH_REASON_ERROR, []),
        ("dup", pb.FINISH_REASON_UNSPECIFIED, [7])]
    finished = SequenceOutput(seq_id=0, token_id=6, finish_reason=FinishReason.LENGTH, num_output_tokens=2,
                              request_finished=True)
    frame = build_frame([("dup", finished), ("dup", new_token)])
    assert [(s.finish_reason, unpack_int32_list(s.token_ids)) for s in frame.sequences] == [
        (pb.FINISH_REASON_LENGTH, [6]), (pb.FINISH_REASON_UNSPECIFIED, [7])]
