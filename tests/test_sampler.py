"""Sampler math alone, on hand-made logits."""

from __future__ import annotations

import torch

from model_worker.sampler import SamplingBatch, SeededGenerators, apply_top_k_top_p, sample
from model_worker.sequence import SamplingParams

CPU = torch.device("cpu")


def batch(params: list[SamplingParams], vocab: int, gens: SeededGenerators | None = None) -> SamplingBatch:
    gens = gens or SeededGenerators(CPU, 0)
    return SamplingBatch.build(params, [gens.for_sequence(i, p.seed) for i, p in enumerate(params)], vocab, CPU)


def test_greedy_picks_argmax_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    out = sample(logits, batch([SamplingParams(logprobs=True, top_logprobs=2)] * 2, 3))
    assert out.token_ids.tolist() == [1, 0]
    expected = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, expected.gather(-1, out.token_ids[:, None])[:, 0])
    assert out.top_token_ids.tolist() == [[1, 2], [0, 1]]


def test_top_k_and_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept_k = apply_top_k_top_p(logits, torch.tensor([[2]]), torch.tensor([[1.0]]), True, False)
    assert torch.isfinite(kept_k).tolist() == [[True, True, False, False]]
    # top_p 0.8: 0.5 + 0.3 reaches it, so the third token is cut.
    kept_p = apply_top_k_top_p(logits, torch.tensor([[4]]), torch.tensor([[0.8]]), False, True)
    assert torch.isfinite(kept_p).tolist() == [[True, True, False, False]]
    # A tiny top_p still keeps the most likely token.
    kept_min = apply_top_k_top_p(logits, torch.tensor([[4]]), torch.tensor([[0.01]]), False, True)
    assert torch.isfinite(kept_min).tolist() == [[True, False, False, False]]


def test_sampling_only_draws_from_allowed_tokens_and_follows_probabilities():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]])).repeat(4000, 1)
    out = sample(logits, batch([SamplingParams(temperature=1.0, top_k=3)] * 4000, 4))
    counts = torch.bincount(out.token_ids, minlength=4).float() / 4000
    assert counts[3] == 0
    assert abs(counts[0] - 0.6) < 0.04 and abs(counts[1] - 0.3) < 0.04


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(5, 100)
    seeded = SamplingParams(temperature=0.8, seed=42)
    alone = [sample(logits[2:3], batch([seeded], 100, gens)).token_ids.item()
             for gens in [SeededGenerators(CPU, 0)] for _ in range(5)]
    gens = SeededGenerators(CPU, 7)
    mixed_params = [SamplingParams(temperature=1.0)] * 2 + [seeded] + [SamplingParams(temperature=1.0)] * 2
    mixed = []
    for _ in range(5):
        b = SamplingBatch.build(mixed_params, [gens.for_sequence(9 if p.seed else i, p.seed)
                                               for i, p in enumerate(mixed_params)], 100, CPU)
        mixed.append(sample(logits, b).token_ids[2].item())
    assert alone == mixed
