"""Beam search: the pure bookkeeping on hand-made candidates, the engine-driven search against
transformers' own beam search on the same tiny random model, and the request over gRPC."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from model_worker.beam_search import BeamCandidates, BeamSearch
from model_worker.beam_search_request import BeamSearchRequest
from model_worker.engine import LLMEngine, RequestRejected
from model_worker.model_runner import ModelRunner
from model_worker.sequence import FinishReason, SamplingParams
from tests.test_model_worker_service import add
from tests.test_paged_attention import hf_model  # noqa: F401  (fixture)
from tests.test_paged_service import by_index, stub  # noqa: F401  (fixture)
from tokenwire.v1 import model_worker_pb2 as pb

EOS = 0


def cands(*pairs: tuple[int, float]) -> BeamCandidates:
    return BeamCandidates([t for t, _ in pairs], [math.log(p) for _, p in pairs])


def test_the_best_joint_candidates_survive_and_a_top_ranked_stop_becomes_a_hypothesis():
    search = BeamSearch(beam_width=2, n=2, max_tokens=10, stop_token_ids=frozenset({EOS}))
    assert search.num_candidates == 4
    search.advance([cands((5, 0.5), (6, 0.3), (7, 0.1), (EOS, 0.05))])
    assert [b.token_ids for b in search.beams] == [[5], [6]]
    # Beam [5] (0.5) continues best with 8 (0.5*0.9); [6] stops at rank 1 (0.3*0.8), which is
    # within the beam width, so it is a hypothesis; [5, 9] takes the second live place.
    search.advance([cands((8, 0.9), (9, 0.05), (10, 0.03), (EOS, 0.02)),
                    cands((EOS, 0.8), (11, 0.1), (12, 0.05), (13, 0.05))])
    assert [b.token_ids for b in search.beams] == [[5, 8], [6, 11]]
    assert [(h.token_ids, h.stopped) for h in search.finished] == [([6, EOS], True)]
    # The stop token counts in the length, as in transformers: score = log(0.3 * 0.8) / 2.
    assert search.finished[0].score == pytest.approx(math.log(0.3 * 0.8) / 2)


def test_a_stop_below_the_beam_width_is_dropped():
    search = BeamSearch(beam_width=1, n=1, max_tokens=10, stop_token_ids=frozenset({EOS}))
    search.advance([cands((5, 0.6), (EOS, 0.3))])
    assert [b.token_ids for b in search.beams] == [[5]] and search.finished == []


def test_max_tokens_ends_every_beam_and_best_is_ranked_by_length_penalised_score():
    search = BeamSearch(beam_width=2, n=2, max_tokens=2, stop_token_ids=frozenset({EOS}), length_penalty=2.0)
    search.advance([cands((5, 0.5), (EOS, 0.4), (6, 0.05), (7, 0.05))])
    # [EOS] ends at once: length 1 -> score log(0.4).
    search.advance([cands((8, 0.9), (9, 0.05), (1, 0.03), (2, 0.02)),
                    cands((10, 0.5), (11, 0.4), (3, 0.05), (4, 0.05))])
    assert search.done and search.beams == []
    best = search.best()
    scores = {tuple(h.token_ids): h.score for h in search.finished}
    assert scores[(5, 8)] == pytest.approx(math.log(0.45) / 4)
    assert [tuple(h.token_ids) for h in best] == sorted(scores, key=scores.get, reverse=True)[:2]
    assert all(not h.stopped for h in best if h.token_ids[-1] != EOS)


def test_search_stops_once_no_live_beam_can_beat_the_kept_hypotheses():
    search = BeamSearch(beam_width=1, n=1, max_tokens=100, stop_token_ids=frozenset({EOS}))
    search.advance([cands((EOS, 0.9), (5, 0.1))])
    # The hypothesis scores log(0.9); the live beam already scores below it and can only fall.
    assert search.done and search.best()[0].token_ids == [EOS]


def test_diversity_penalty_pushes_beams_to_different_tokens():
    plain = BeamSearch(beam_width=2, n=2, max_tokens=1, stop_token_ids=frozenset())
    plain.advance([cands((5, 0.9), (6, 0.05), (7, 0.03), (8, 0.02))])
    diverse = BeamSearch(beam_width=2, n=2, max_tokens=1, stop_token_ids=frozenset(), diversity_penalty=5.0)
    row = cands((5, 0.9), (6, 0.05), (7, 0.03), (8, 0.02))
    diverse.advance([row, row])  # both groups start from the prompt
    assert [h.token_ids for h in plain.best()] == [[5], [6]]
    assert sorted(h.token_ids[0] for h in diverse.best()) == [5, 6]
    weak = BeamSearch(beam_width=2, n=2, max_tokens=1, stop_token_ids=frozenset(), diversity_penalty=0.01)
    weak.advance([row, row])
    assert [h.token_ids for h in weak.best()] == [[5], [5]]  # a tiny penalty cannot beat 0.9 vs 0.05


def make_engine(tiny_model_dir, max_waiting_requests: int = 64) -> LLMEngine:
    runner = ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.float32, 8, 128, kv_cache_tokens=1024,
                         block_size=8)
    return LLMEngine(runner, eos_token_ids=[EOS], max_num_seqs=8, max_num_batched_tokens=256,
                     max_waiting_requests=max_waiting_requests)


def run_beam(engine: LLMEngine, prompt: list[int], **kwargs) -> list:
    ids = iter(range(1000, 10**6))
    request = BeamSearchRequest(engine, lambda: next(ids), 7, prompt, kwargs.pop("sampling", SamplingParams()),
                                kwargs.pop("max_tokens"), kwargs.pop("stop_token_ids", []), False, kwargs.pop("n"),
                                kwargs.pop("best_of"),
                                kwargs.pop("length_penalty", 1.0), kwargs.pop("diversity_penalty", 0.0))
    request.start()
    while engine.has_work():
        for out in engine.step():
            final = request.on_output(out)
            if final is not None:
                assert not engine.has_work()
                return final
    raise AssertionError("beam search never finished")


def test_engine_beam_search_equals_transformers_beam_search(tiny_model_dir, hf_model):  # noqa: F811
    engine = make_engine(tiny_model_dir)
    prompt = [11, 220, 3021, 87, 5, 901, 4410]
    outputs = run_beam(engine, prompt, max_tokens=6, n=2, best_of=3)
    by_index_: dict[int, list[int]] = {}
    for out in outputs:
        by_index_.setdefault(out.index, []).append(out.token_id)
    assert outputs[-1].request_finished and all(not o.request_finished for o in outputs[:-1])
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False,
                                early_stopping=False, length_penalty=1.0, eos_token_id=EOS, pad_token_id=EOS)
    expected = [row[len(prompt):].tolist() for row in ref]
    assert [by_index_[0], by_index_[1]] == expected
    # Every round request ended and freed its blocks (the prefix cache may keep them cached).
    assert engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def eos_heavy(tiny_model_dir, tmp_path_factory):
    """A tiny Llama whose lm_head makes EOS a likely next token, and its runner."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_hf_models import perturb_weights, save_tiny_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=256, tie_word_embeddings=False,
                                         bos_token_id=1, eos_token_id=EOS)).eval()
    perturb_weights(model)
    with torch.no_grad():  # EOS's logit about as high as the best token's, on average
        hidden = model.model(torch.randint(3, 512, (8, 10))).last_hidden_state.reshape(-1, 64)
        mean = hidden.mean(0)
        model.lm_head.weight[EOS] = mean / mean.dot(mean) * model.lm_head(hidden).max(-1).values.mean() * 1.1
    runner = ModelRunner(save_tiny_model(model, tmp_path_factory.mktemp("eos_heavy"), tiny_model_dir), "auto",
                         torch.device("cpu"), torch.float32, 8, 128)
    return model, runner


def test_searches_with_several_stop_ids_equal_transformers(eos_heavy):
    """Stop ids beside EOS that rank just below the beam width: transformers keeps (1 + stop ids)
    x W candidates a step; with 2W, a round could keep fewer than W live beams, and 2 of 60 such
    searches ended on lower-scoring hypotheses (review 94)."""
    model, runner = eos_heavy
    generator = torch.Generator().manual_seed(11)
    for _ in range(40):
        prompt = torch.randint(3, 512, (int(torch.randint(1, 10, (), generator=generator)),), generator=generator).tolist()
        width = int(torch.randint(2, 4, (), generator=generator))
        n = int(torch.randint(1, width + 1, (), generator=generator))
        max_tokens = int(torch.randint(2, 8, (), generator=generator))
        with torch.inference_mode():
            top = model(torch.tensor([prompt])).logits[0, -1].topk(6).indices.tolist()
        k = int(torch.randint(2, 5, (), generator=generator))
        stops = [t for t in top[1:k + 2] if t != EOS][:k]
        engine = LLMEngine(runner, eos_token_ids=[EOS], max_num_seqs=8, max_num_batched_tokens=256,
                           max_waiting_requests=64)
        got: dict[int, list[int]] = {}
        for out in run_beam(engine, prompt, max_tokens=max_tokens, n=n, best_of=width, stop_token_ids=stops):
            got.setdefault(out.index, []).append(out.token_id)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens, do_sample=False,
                                 early_stopping=False, eos_token_id=[EOS, *stops], pad_token_id=EOS)
        expected = []
        for row in ref.tolist():
            tokens = row[len(prompt):]
            end = next((i for i, t in enumerate(tokens) if t in (EOS, *stops)), None)
            expected.append(tokens if end is None else tokens[:end + 1])
        assert [got[i] for i in range(n)] == expected, (prompt, width, n, max_tokens, stops)


def test_searches_that_end_on_the_stop_token_equal_transformers(eos_heavy):
    """The stop token's place in a finished hypothesis' length: random searches on a model whose
    lm_head makes EOS a likely next token, against transformers' generate. Leaving it out of the
    length (vLLM's count) ranks some of these differently."""
    model, runner = eos_heavy
    generator = torch.Generator().manual_seed(3)
    ended_on_eos = 0
    for _ in range(40):
        prompt = torch.randint(3, 512, (int(torch.randint(1, 13, ()),),), generator=generator).tolist()
        width = int(torch.randint(2, 5, (), generator=generator))
        n = int(torch.randint(1, width + 1, (), generator=generator))
        max_tokens = int(torch.randint(1, 9, (), generator=generator))
        length_penalty = [1.0, 0.0, 2.0, -1.0][int(torch.randint(0, 4, (), generator=generator))]
        engine = LLMEngine(runner, eos_token_ids=[EOS], max_num_seqs=8, max_num_batched_tokens=256,
                           max_waiting_requests=64)
        got: dict[int, list[int]] = {}
        for out in run_beam(engine, prompt, max_tokens=max_tokens, n=n, best_of=width, length_penalty=length_penalty):
            got.setdefault(out.index, []).append(out.token_id)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens, do_sample=False,
                                 early_stopping=False, length_penalty=length_penalty, eos_token_id=EOS,
                                 pad_token_id=EOS)
        expected = []
        for row in ref.tolist():
            tokens = row[len(prompt):]
            expected.append(tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens)
        ended_on_eos += any(EOS in tokens for tokens in expected)
        assert [got[i] for i in range(n)] == expected, (prompt, width, n, max_tokens, length_penalty)
    assert ended_on_eos >= 3  # the searches do end on the stop token


def test_beam_search_rejects_sampling_knobs(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    for sampling, field in ((SamplingParams(temperature=0.7), "sampling.temperature"),
                            (SamplingParams(top_k=5), "sampling.top_k"), (SamplingParams(top_p=0.5), "sampling.top_p")):
        with pytest.raises(RequestRejected, match="temperature must be 0") as info:
            run_beam(engine, [1, 2, 3], sampling=sampling, max_tokens=4, n=1, best_of=2)
        assert info.value.field == field  # the gateway names the body's parameter from it
    with pytest.raises(RequestRejected, match="n <= best_of"):
        run_beam(engine, [1, 2, 3], max_tokens=4, n=3, best_of=2)


@pytest.mark.parametrize("setting", [
    {"min_p": 0.1}, {"typical_p": 0.9}, {"top_n_sigma": 1.0}, {"xtc_probability": 0.5}, {"dry_multiplier": 0.8},
    {"mirostat": 2}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2},
    {"repeat_penalty": 1.1}, {"logit_bias": ((5, 3.0),)}, {"min_tokens": 3}, {"bad_words": ((5,),)},
    {"allowed_token_ids": (1, 2)}, {"prompt_logprobs": 0},
])
def test_beam_search_refuses_settings_its_rounds_would_drop(tiny_model_dir, setting):
    engine = make_engine(tiny_model_dir)
    (name,) = setting
    with pytest.raises(RequestRejected, match=f"beam search does not support {name}") as info:
        run_beam(engine, [1, 2, 3], sampling=SamplingParams(**setting), max_tokens=4, n=1, best_of=2)
    assert info.value.field == (name if name == "prompt_logprobs" else f"sampling.{name}")
    assert not engine.has_work()
    # logprobs and their count are what beam search reports, so they stay allowed.
    run_beam(engine, [1, 2, 3], sampling=SamplingParams(logprobs=True, top_logprobs=2, seed=3), max_tokens=2, n=1,
             best_of=2)


def test_a_search_is_admitted_as_one_request_whatever_its_width(tiny_model_dir):
    # As a request's n samples are: a beam wider than the waiting queue still runs (its rounds
    # are not counted against it); a full queue refuses the search with nothing of it queued.
    engine = make_engine(tiny_model_dir, max_waiting_requests=2)
    outputs = run_beam(engine, [1, 2, 3], max_tokens=3, n=2, best_of=4, diversity_penalty=1.0)
    assert {o.index for o in outputs} == {0, 1} and not engine.has_work()
    # The 8 seats take the first 8 requests at the next step; 2 more fill the waiting room.
    for seq_id in range(1, 11):
        engine.add_request(seq_id, [1, 2], SamplingParams(), max_tokens=2, stop_token_ids=[], ignore_eos=True)
    with pytest.raises(RequestRejected, match="2 requests are already waiting") as info:
        run_beam(engine, [1, 2, 3], max_tokens=4, n=1, best_of=4, diversity_penalty=1.0)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sorted(engine.groups) == list(range(1, 11)) and len(engine.scheduler.waiting) == 10


def test_later_rounds_are_not_refused_when_other_requests_fill_the_queue(tiny_model_dir):
    # The search was admitted with room for a round; its later rounds replace that round's
    # requests, so a queue that others filled meanwhile does not end it half way.
    engine = make_engine(tiny_model_dir, max_waiting_requests=3)
    ids = iter(range(1000, 10**6))
    request = BeamSearchRequest(engine, lambda: next(ids), 7, [1, 2, 3], SamplingParams(), 4, [], True, 1, 3,
                                1.0, 0.0)
    request.start()
    others = iter(range(100))
    final = None
    filled = 0
    while final is None:
        for out in engine.step():
            if out.seq_id in request.in_flight:
                while len(engine.scheduler.waiting) < engine.max_waiting_requests:  # full as the round is added
                    engine.add_request(next(others), [4, 5], SamplingParams(), max_tokens=1, stop_token_ids=[],
                                       ignore_eos=True)
                    filled += 1
                final = request.on_output(out) or final
    assert filled >= 3
    assert len({o.index for o in final}) == 1 and max(o.num_output_tokens for o in final) == 4


def test_beam_search_checks_the_users_settings_as_any_request_does(tiny_model_dir):
    # Its rounds carry their own greedy settings, so the user's are checked up front.
    engine = make_engine(tiny_model_dir)
    ids = iter(range(1000, 10**6))
    for prompt, sampling, stop_ids, diversity, message in [
        ([1, 2, 3], SamplingParams(), [10**9], 0.0, "stop token id"),
        ([1, 2, 3], SamplingParams(min_tokens=-7), [], 0.0, "min_tokens"),
        ([1, 2, 3], SamplingParams(top_logprobs=-1), [], 0.0, "top_logprobs"),
        ([], SamplingParams(), [], 0.0, "empty"),
        ([1, 2, 3], SamplingParams(), [], math.inf, "diversity_penalty"),
    ]:
        with pytest.raises(RequestRejected, match=message):
            BeamSearchRequest(engine, lambda: next(ids), 7, prompt, sampling, 4, stop_ids, False, 1, 2, 1.0,
                              diversity).start()
    with pytest.raises(RequestRejected, match="length_penalty"):
        run_beam(engine, [1, 2, 3], max_tokens=4, n=1, best_of=2, length_penalty=-2000.0)
    assert not engine.has_work()


@pytest.mark.slow
def test_beam_search_over_grpc_sends_n_ranked_outputs_at_the_end(stub):  # noqa: F811
    request = add("beam", [1, 2, 3, 4, 5], 5, n=2, best_of=3, use_beam_search=True, logprobs=True, top_logprobs=2)
    results = by_index(stub, [pb.RequestFrame(adds=[request])], "beam")
    assert set(results) == {0, 1}
    for r in results.values():
        assert 1 <= len(r["tokens"]) <= 5
        assert r["finishes"] and r["finishes"][-1] in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    bad = add("beam-bad", [1, 2, 3], 5, n=1, best_of=2, use_beam_search=True,
              sampling=pb.SamplingParams(temperature=0.8))
    frames = list(stub.Generate(iter([pb.RequestFrame(adds=[bad])]), timeout=30))
    seqs = [s for f in frames for s in f.sequences]
    assert seqs[-1].finish_reason == pb.FINISH_REASON_ERROR and "temperature must be 0" in seqs[-1].error.message
    assert FinishReason.ERROR == pb.FINISH_REASON_ERROR
