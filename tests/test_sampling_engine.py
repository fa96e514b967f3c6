"""The sampler inside the engine (tiny random model): seeded requests replay identically whatever
else runs (bitwise, logprobs included, under --batch-invariant), rejected params get clear
messages, and prompt logprobs come with the first token."""

from __future__ import annotations

import math
from array import array
from dataclasses import replace

import grpc
import pytest
import torch

from model_worker.engine import LLMEngine, RequestRejected
from model_worker.model_runner import ModelRunner
from model_worker.sequence import FinishReason, LogprobsMode, SamplerOrder, SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=16, max_model_len=256)


def run_engine(runner, requests: dict[int, tuple[list[int], SamplingParams, int]], max_num_batched_tokens=512,
               seed=0) -> dict[int, dict]:
    engine = LLMEngine(runner, [], max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                       max_waiting_requests=100, seed=seed)
    for rid, (prompt, params, max_tokens) in requests.items():
        engine.add_request(rid, prompt, params, max_tokens, [], True)
    results = {rid: {"tokens": [], "logprobs": [], "top": [], "top_logprobs": [], "prompt": None,
                     "cumulative": None} for rid in requests}
    while engine.has_work():
        for out in engine.step():
            r = results[out.seq_id]
            if out.token_id is not None:
                r["tokens"].append(out.token_id)
                r["logprobs"].append(out.logprob)
                r["top"].append(out.top_token_ids)
                r["top_logprobs"].append(out.top_logprobs)
                r["cumulative"] = out.cumulative_logprob
            if out.prompt_logprobs is not None:
                r["prompt"] = out.prompt_logprobs
    return results


SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                        frequency_penalty=0.3, seed=1234, logprobs=True, top_logprobs=3)


def other_requests(count: int) -> dict[int, tuple[list[int], SamplingParams, int]]:
    variants = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=10, seed=5, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=1.2, typical_p=0.9, presence_penalty=0.5, sampler_order=SamplerOrder.LLAMA_CPP),
        SamplingParams(temperature=1.0, dry_multiplier=0.8, repeat_penalty=1.2, penalty_last_n=16),
        SamplingParams(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.1, top_n_sigma=1.5),
        SamplingParams(temperature=1.0, mirostat=2, logprobs=True, logprobs_mode=LogprobsMode.PROCESSED),
        SamplingParams(min_tokens=4, bad_words=((10, 11),), logit_bias=((42, 5.0),)),
    ]
    return {100 + i: ([(7 * i + j) % 5000 + 3 for j in range(3 + 5 * i)], variants[i % len(variants)], 4 + i % 6)
            for i in range(count)}


def test_seeded_request_is_identical_alone_and_amid_15_others(runner):
    prompt = [5, 17, 23, 99, 1000, 42]
    alone = run_engine(runner, {1: (prompt, SEEDED, 12)})[1]
    # The seeded request arrives in the middle, so it sits at another row and prefills alongside others.
    crowd = other_requests(15)
    requests = dict(list(crowd.items())[:7]) | {1: (prompt, SEEDED, 12)} | dict(list(crowd.items())[7:])
    amid = run_engine(runner, requests, max_num_batched_tokens=64)
    assert len(alone["tokens"]) == 12
    assert amid[1]["tokens"] == alone["tokens"]
    assert amid[1]["top"] == alone["top"]
    # The model's float32 forward itself differs in the last bits with the batch's shape (GEMM
    # blocking), so logprobs agree to ~1e-6 here; the sampler's own part is bitwise row-independent
    # (test_sampler.py checks that on fixed logits).
    assert amid[1]["logprobs"] == pytest.approx(alone["logprobs"], abs=1e-5)
    assert all(len(r["tokens"]) == requests[rid][2] for rid, r in amid.items())


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def invariant_runner(request, tiny_model_dir):
    return ModelRunner(tiny_model_dir, "dummy", CPU, request.param, max_num_seqs=16, max_model_len=256,
                       batch_invariant=True)


def same_bits(a: list[float], b: list[float]) -> bool:
    """Bitwise equal lists of floats (NaN placeholders included)."""
    return array("d", a).tobytes() == array("d", b).tobytes()


def test_batch_invariant_mode_gives_bitwise_identical_logprobs_alone_and_amid_15_others(invariant_runner):
    prompt = [(11 * j) % 3000 + 7 for j in range(40)]
    params = replace(SEEDED, prompt_logprobs=2)
    # The whole 40-token prompt in one chunk, alone: the reference.
    alone = run_engine(invariant_runner, {1: (prompt, params, 12)})[1]
    crowd = other_requests(15)
    requests = dict(list(crowd.items())[:7]) | {1: (prompt, params, 12)} | dict(list(crowd.items())[7:])
    # Other prefill splits (7-token chunks alone; behind 126 prompt tokens of 7 others in 64- and
    # 29-token steps) and other batches: rows, neighbours' lengths and decode batch sizes all differ.
    runs = {"alone, 7-token steps": run_engine(invariant_runner, {1: (prompt, params, 12)}, max_num_batched_tokens=7),
            "amid 15, 64-token steps": run_engine(invariant_runner, requests, max_num_batched_tokens=64),
            "amid 15, 29-token steps": run_engine(invariant_runner, requests, max_num_batched_tokens=29)}
    assert len(alone["tokens"]) == 12 and len(alone["prompt"].logprobs) == len(prompt)
    for name, results in runs.items():
        r = results[1]
        assert r["tokens"] == alone["tokens"], name
        assert r["top"] == alone["top"], name
        assert same_bits(r["logprobs"], alone["logprobs"]), name
        assert all(same_bits(a, b) for a, b in zip(r["top_logprobs"], alone["top_logprobs"], strict=True)), name
        assert r["prompt"].top_token_ids == alone["prompt"].top_token_ids, name
        assert same_bits(r["prompt"].logprobs, alone["prompt"].logprobs), name
        assert same_bits(r["prompt"].top_logprobs, alone["prompt"].top_logprobs), name
    crowded = runs["amid 15, 29-token steps"]
    assert all(len(r["tokens"]) == requests[rid][2] for rid, r in crowded.items())


def test_unseeded_requests_draw_differently(runner):
    params = SamplingParams(temperature=1.0)
    results = run_engine(runner, {1: ([5, 6, 7], params, 16), 2: ([5, 6, 7], params, 16)})
    assert results[1]["tokens"] != results[2]["tokens"]


def test_a_refused_request_does_not_shift_the_unseeded_draws(runner):
    """With the engine's seed fixed, unseeded requests replay; a request refused at admission (here
    best_of < n) must not use up a draw, or every later unseeded request would sample differently."""
    def run(refuse_first: bool) -> list[int]:
        engine = LLMEngine(runner, [], max_num_seqs=16, max_num_batched_tokens=512, max_waiting_requests=100, seed=7)
        if refuse_first:
            with pytest.raises(RequestRejected):
                engine.add_request(0, [5, 6, 7], SamplingParams(temperature=1.0), 4, [], True, n=2, best_of=1)
        engine.add_request(1, [5, 6, 7], SamplingParams(temperature=1.0), 12, [], True)
        tokens = []
        while engine.has_work():
            tokens.extend(out.token_id for out in engine.step() if out.token_id is not None)
        return tokens

    assert run(refuse_first=True) == run(refuse_first=False)


def test_ids_past_the_tokenizer_are_never_picked(runner, tiny_model_dir):
    """A vocabulary padded past the tokenizer's (Qwen2/2.5): the padding ids are never drawn nor
    offered as alternatives, whatever the temperature; with the tokenizer's full size nothing changes."""
    from tokenwire.tokenizer_files import num_token_ids

    assert num_token_ids(tiny_model_dir) == runner.vocab_size  # SmolLM2's tokenizer: no padding
    engine = LLMEngine(runner, [], max_num_seqs=16, max_num_batched_tokens=512, max_waiting_requests=100,
                       num_token_ids=300)
    params = SamplingParams(temperature=5.0, logprobs=True, top_logprobs=20, prompt_logprobs=20)
    for rid in range(4):
        engine.add_request(rid, [5, 6, 7, 8], replace(params, seed=rid), 32, [], True)
    seen: set[int] = set()
    while engine.has_work():
        for out in engine.step():
            seen.update([out.token_id, *out.top_token_ids] if out.token_id is not None else [])
            if out.prompt_logprobs is not None:
                seen.update(t for t in out.prompt_logprobs.top_token_ids if t >= 0)
    assert len(seen) > 20 and max(seen) < 300, sorted(seen)[-5:]
    # allowed_token_ids of padding ids alone leave nothing to draw (token 0 came, allowed or not).
    with pytest.raises(RequestRejected, match="all padding ids") as refused:
        engine.add_request(9, [5, 6, 7], SamplingParams(allowed_token_ids=(300, 400)), 4, [], True)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.field == "sampling.allowed_token_ids"
    engine.add_request(10, [5, 6, 7], SamplingParams(allowed_token_ids=(299, 400)), 4, [], True)  # one is a token
    tokens = [out.token_id for out in engine.step()]
    assert tokens == [299]


def test_a_bad_request_is_refused_as_bad_even_when_the_queue_is_full(runner):
    engine = LLMEngine(runner, [], max_num_seqs=1, max_num_batched_tokens=512, max_waiting_requests=1)
    engine.add_request(0, [5, 6, 7], SamplingParams(), 4, [], True)  # the one seat takes it
    engine.add_request(1, [5, 6, 7], SamplingParams(), 4, [], True)  # waits: the queue is full
    with pytest.raises(RequestRejected) as bad:
        engine.add_request(2, [5, 6, 7], SamplingParams(), 4, [], True, n=2, best_of=1)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED: a retry cannot help
    with pytest.raises(RequestRejected) as full:
        engine.add_request(3, [5, 6, 7], SamplingParams(), 4, [], True)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_cumulative_logprob_is_the_sum_of_raw_logprobs(runner):
    params = SamplingParams(temperature=1.0, seed=9, logprobs=True)
    r = run_engine(runner, {1: ([5, 6, 7], params, 10)})[1]
    assert math.isclose(r["cumulative"], sum(r["logprobs"]), rel_tol=1e-5)


def test_best_of_returns_the_prompt_logprobs_whichever_samples_win(runner):
    """They are computed once, with sample 0's first token; best_of > n returns the best samples,
    often not sample 0, and the prompt logprobs went with it (the gateway then answered 400)."""
    engine = LLMEngine(runner, [], max_num_seqs=16, max_num_batched_tokens=512, max_waiting_requests=100)
    params = SamplingParams(temperature=1.0, prompt_logprobs=0)
    prompt = [5, 17, 301, 42, 9]
    for rid in range(12):
        engine.add_request(rid, prompt, replace(params, seed=rid), 4, [], True, n=1, best_of=4)
    prompt_records: dict[int, list] = {rid: [] for rid in range(12)}
    while engine.has_work():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                prompt_records[out.seq_id].append(out.prompt_logprobs)
    # Each request's one output carries them once, over every prompt position (a 1 in 4 chance
    # per request that sample 0 wins: 12 requests all pass by luck once in ~17 million).
    assert all(len(records) == 1 for records in prompt_records.values()), prompt_records
    assert all(records[0].num_positions == len(prompt) for records in prompt_records.values())


def test_mirostat_state_of_ended_requests_is_forgotten(runner):
    """Each batch rebuild carried every mirostat row's mu over, those of sequences that had just
    ended included: one entry per mirostat request, kept forever. A live one's still carries over."""
    engine = LLMEngine(runner, [], max_num_seqs=16, max_num_batched_tokens=512, max_waiting_requests=100)
    mirostat = SamplingParams(temperature=1.0, seed=3, mirostat=2)
    engine.add_request(0, [5, 6, 7], mirostat, 40, [], True)  # runs through all the others
    for rid in range(1, 21):
        engine.add_request(rid, [5, 6, 7, rid], replace(mirostat, seed=rid), 2, [], True)
        engine.step()
        engine.step()
    assert set(engine.sampler._saved_mu) <= {0}
    while engine.has_work():
        engine.step()
    assert not engine.sampler._saved_mu


def test_prompt_logprobs_across_chunks_match_one_forward(runner):
    prompt = [(13 * j) % 4000 + 5 for j in range(40)]
    params = SamplingParams(prompt_logprobs=2)
    chunked = run_engine(runner, {1: (prompt, params, 2)}, max_num_batched_tokens=16)[1]["prompt"]
    whole = run_engine(runner, {1: (prompt, params, 2)}, max_num_batched_tokens=512)[1]["prompt"]
    assert len(chunked.logprobs) == len(prompt) and math.isnan(chunked.logprobs[0])
    assert chunked.top_token_ids[:2] == [-1, -1] and len(chunked.top_token_ids) == 2 * len(prompt)
    assert chunked.logprobs[1:] == pytest.approx(whole.logprobs[1:], abs=1e-4)
    assert chunked.top_token_ids[2:] == whole.top_token_ids[2:]
    assert all(lp <= 0 for lp in chunked.logprobs[1:])
    # The top alternative is at least as likely as the actual token.
    assert all(chunked.top_logprobs[2 * i] >= chunked.logprobs[i] - 1e-6 for i in range(1, len(prompt)))
    # Each token's rank: 1 where it is the top alternative, 2 where the second, else above 2.
    assert chunked.ranks[0] == 0 and chunked.ranks[1:] == whole.ranks[1:]
    for i in range(1, len(prompt)):
        top2 = chunked.top_token_ids[2 * i:2 * i + 2]
        expected = top2.index(prompt[i]) + 1 if prompt[i] in top2 else None
        assert chunked.ranks[i] == expected if expected else chunked.ranks[i] > 2, (i, chunked.ranks[i], top2)


def test_prompt_token_rank_counts_ties_as_ahead_as_vllm():
    from model_worker.sampling.prompt_logprobs import PromptLogprobs

    record = PromptLogprobs(0)
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])  # after positions 0 and 1
    record.add_chunk(logits, 0, [9, 2, 1])
    # Token 2 after position 0: tokens 1 and 3 above it, itself: 3. Token 1 after position 1: token 0
    # above it, token 2 tied with it, itself: 3 (vLLM: the count of logprobs >= the token's).
    assert record.ranks == [0, 3, 3]
    record.pad_to(5)
    assert record.ranks == [0, 3, 3, 0, 0]


@pytest.mark.parametrize(("params", "max_tokens", "message"), [
    (SamplingParams(min_p=1.5), 8, "min_p"),
    (SamplingParams(typical_p=-0.1), 8, "typical_p"),
    (SamplingParams(mirostat=1), 8, "mirostat"),
    (SamplingParams(presence_penalty=3.0), 8, "presence_penalty"),
    (SamplingParams(repetition_penalty=-1.0), 8, "repetition_penalty"),
    (SamplingParams(penalty_last_n=-2), 8, "penalty_last_n"),
    (SamplingParams(logit_bias=((10**6, 1.0),)), 8, "logit_bias"),
    (SamplingParams(bad_words=((),)), 8, "bad_words"),
    (SamplingParams(allowed_token_ids=(-1,)), 8, "allowed_token_ids"),
    (SamplingParams(min_tokens=9), 8, "min_tokens"),
    (SamplingParams(dry_multiplier=1.0, dry_base=0.5), 8, "dry_base"),
    (SamplingParams(xtc_probability=2.0), 8, "xtc_probability"),
    (SamplingParams(prompt_logprobs=-1), 8, "prompt_logprobs"),
    # Past float32, where the sampler works: 0 (every seen token's logit inf) and inf (review 100)
    (SamplingParams(repetition_penalty=1e-300), 8, "repetition_penalty"),
    (SamplingParams(repeat_penalty=1e-40), 8, "repeat_penalty"),
    (SamplingParams(temperature=1e39, allowed_token_ids=(5, 6)), 8, "temperature"),
])
def test_invalid_sampling_params_are_rejected_with_their_name(runner, params, max_tokens, message):
    engine = LLMEngine(runner, [], max_num_seqs=4, max_num_batched_tokens=64, max_waiting_requests=10)
    with pytest.raises(RequestRejected) as err:
        engine.add_request(1, [1, 2, 3], params, max_tokens, [], True)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.message


@pytest.mark.parametrize(("sampling", "stop", "ignore_eos"), [
    # a two-token bad word bans the only allowed token once its first token is out
    (SamplingParams(allowed_token_ids=(81,), bad_words=((81, 81),)), [], True),
    # min_tokens holds off the stop ids, and they are all that allowed_token_ids leaves
    (SamplingParams(allowed_token_ids=(83,), min_tokens=1), [83], False),
    (SamplingParams(temperature=1.0, seed=1, allowed_token_ids=(2, 83), min_tokens=2), [83], False),
], ids=["bad-word", "min-tokens-greedy", "min-tokens-sampled"])
def test_a_sample_whose_own_masks_leave_no_token_ends_with_an_error(runner, sampling, stop, ignore_eos):
    """Every logit -inf: the draw was token 0, outside allowed_token_ids, streamed on without a
    word (every second token, in the bad-word case). Now the sample ends there with an error, as a
    grammar's dead end does, beside a request that goes on untouched."""
    engine = LLMEngine(runner, [2], max_num_seqs=16, max_num_batched_tokens=512, max_waiting_requests=100)
    engine.add_request(1, [1, 4093, 198, 19556], sampling, 6, stop, ignore_eos)
    engine.add_request(2, [1, 4093, 198, 19556], SamplingParams(allowed_token_ids=(81, 82)), 6, [], True)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    mine = [o for o in outputs if o.seq_id == 1]
    assert mine[-1].finish_reason == FinishReason.ERROR and "no token was left" in mine[-1].error
    assert all(o.token_id in sampling.allowed_token_ids for o in mine[:-1])
    other = [o for o in outputs if o.seq_id == 2]
    assert len(other) == 6 and {o.token_id for o in other} <= {81, 82} and other[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_holds_off_eos_under_ignore_eos_too(runner):
    # vLLM's rule: min_tokens masks eos whatever ignore_eos says. ignore_eos + min_tokens (the
    # fixed-length benchmark recipe) wrote eos ids inside the output, empty text (review 100).
    eos = 2
    engine = LLMEngine(runner, [eos], max_num_seqs=16, max_num_batched_tokens=512, max_waiting_requests=100)
    biased = SamplingParams(logit_bias=((eos, 100.0),), min_tokens=3)
    engine.add_request(1, [1, 4093, 198], biased, 5, [], True)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    tokens = [o.token_id for o in outputs]
    assert len(tokens) == 5 and eos not in tokens[:3] and tokens[3:] == [eos, eos], tokens
    assert outputs[-1].finish_reason == FinishReason.LENGTH  # ignore_eos: eos did not end it


@pytest.mark.parametrize(("temperature", "sampled_at"), [(1e-6, 0.01), (0.004, 0.01), (0.0, 0.0), (0.5, 0.5)])
def test_a_positive_temperature_below_a_hundredth_samples_at_a_hundredth(temperature, sampled_at):
    # vLLM's _MAX_TEMP: no positive temperature is greedy (below 1e-5 was greedy, review 100).
    from model_worker.servicer import sampling_from_proto
    from tokenwire.v1 import model_worker_pb2 as pb

    add = pb.AddRequest(request_id="r", prompt_token_ids=[1])
    add.sampling.temperature = temperature
    assert sampling_from_proto(add).temperature == pytest.approx(sampled_at)
    add.sampling.sampler_order = SamplerOrder.LLAMA_CPP  # llama.cpp's own chain keeps it
    assert sampling_from_proto(add).temperature == pytest.approx(temperature)
