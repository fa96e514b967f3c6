"""Parity with transformers' own logits processors and warpers on real SmolLM2 logits: the same
kept-token sets and the same processed logits (float tolerance). One forward, cached per session."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from model_worker.sampling import Sampler, processors
from model_worker.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
PROMPT = ("<|im_start|>user\nWrite a short poem about the sea, the wind and the stars, and explain "
          "why sailors love them.<|im_end|>\n<|im_start|>assistant\nThe sea is")
EOS = 2


@pytest.fixture(scope="session")
def real_logits(smollm2_dir, smollm2):
    """(input_ids [T] long, logits [T, V] float32): SmolLM2's logits after every prompt position."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(smollm2.encode(PROMPT).ids)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(ids[None, :]).logits[0].float()
    return ids, logits


@pytest.fixture
def rows(real_logits) -> torch.Tensor:
    """[8, V]: the last 8 positions, from confident to flat distributions."""
    return real_logits[1][-8:].clone()


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    kept_ours, kept_theirs = torch.isfinite(ours), torch.isfinite(theirs)
    assert torch.equal(kept_ours, kept_theirs), (kept_ours.sum(-1), kept_theirs.sum(-1))
    assert torch.allclose(ours[kept_ours], theirs[kept_theirs], rtol=1e-5, atol=1e-5)


def column(value, dtype=torch.float32, rows=8) -> torch.Tensor:
    return torch.full((rows, 1), value, dtype=dtype)


def hf(processor, scores: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    if input_ids is None:
        input_ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    return processor(input_ids, scores.clone())


@pytest.mark.parametrize("t", [0.3, 0.7, 1.5])
def test_temperature(rows, t):
    assert_same(processors.apply_temperature(rows, column(t)), hf(TemperatureLogitsWarper(t), rows))


@pytest.mark.parametrize("k", [1, 5, 50, 1000])
def test_top_k(rows, k):
    ours = processors.top_k(rows, column(k, torch.long), k)
    assert_same(ours, hf(TopKLogitsWarper(k), rows))
    assert (torch.isfinite(ours).sum(-1) >= k).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8, 0.9, 0.95, 0.99])
def test_top_p(rows, p):
    for t in (0.7, 1.0, 1.3):  # more and less peaked distributions
        scaled = rows / t
        assert_same(processors.top_p(scaled, column(p)), hf(TopPLogitsWarper(p), scaled))


@pytest.mark.parametrize("p", [0.01, 0.05, 0.1, 0.3])
def test_min_p(rows, p):
    assert_same(processors.min_p(rows, column(p)), hf(MinPLogitsWarper(p), rows))


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.95])
def test_typical_p(rows, mass):
    assert_same(processors.typical_p(rows, column(mass)), hf(TypicalLogitsWarper(mass), rows))


def seqs_for(params: SamplingParams, prompt: list[int], outputs: list[list[int]]) -> list[Sequence]:
    return [Sequence(seq_id=i, prompt_token_ids=list(prompt), sampling=params, max_tokens=100,
                     stop_token_ids=frozenset({EOS}), output_token_ids=list(out)) for i, out in enumerate(outputs)]


def outputs_from(real_logits) -> tuple[list[int], list[list[int]]]:
    ids = real_logits[0].tolist()
    prompt = ids[:-8]
    # Row i continues the prompt with the real next tokens up to position i (the rows' own context).
    return prompt, [ids[len(prompt):len(prompt) + i] for i in range(8)]


@pytest.mark.parametrize("penalty", [0.8, 1.2, 1.5])
def test_repetition_penalty_over_prompt_and_output(real_logits, rows, penalty):
    prompt, outputs = outputs_from(real_logits)
    seqs = seqs_for(SamplingParams(repetition_penalty=penalty), prompt, outputs)
    ours = Sampler(rows.shape[1], CPU).processed_logits(rows, seqs)
    theirs = torch.stack([hf(RepetitionPenaltyLogitsProcessor(penalty), rows[i:i + 1],
                             torch.tensor([prompt + outputs[i]]))[0] for i in range(8)])
    assert_same(ours, theirs)
    assert not torch.equal(ours, rows)


@pytest.mark.parametrize("min_new", [1, 3, 6])
def test_min_tokens_masks_eos_like_min_new_tokens(real_logits, rows, min_new):
    prompt, outputs = outputs_from(real_logits)
    seqs = seqs_for(SamplingParams(min_tokens=min_new), prompt, outputs)
    ours = Sampler(rows.shape[1], CPU).processed_logits(rows, seqs)
    theirs = torch.stack([hf(MinNewTokensLengthLogitsProcessor(len(prompt), min_new, EOS), rows[i:i + 1],
                             torch.tensor([prompt + outputs[i]]))[0] for i in range(8)])
    assert_same(ours, theirs)
    assert torch.isinf(ours[:min_new, EOS]).all()


def test_bad_words_like_no_bad_words(real_logits, rows):
    prompt, outputs = outputs_from(real_logits)
    top = rows.argmax(-1).tolist()
    # Single-token words (always banned) and two-token words whose prefix is some rows' last token.
    words = [[top[0]], [top[5]], [outputs[3][-1], top[3]], [outputs[6][-1], 17], [99, 100, 101]]
    seqs = seqs_for(SamplingParams(bad_words=tuple(tuple(w) for w in words)), prompt, outputs)
    ours = Sampler(rows.shape[1], CPU).processed_logits(rows, seqs)
    # The proto bans a word when the *output* ends with its prefix: HF sees the output only.
    theirs = torch.stack([hf(NoBadWordsLogitsProcessor(words, EOS), rows[i:i + 1],
                             torch.tensor([outputs[i] or [0]]))[0] for i in range(8)])
    assert_same(ours, theirs)
    assert torch.isinf(ours[3, top[3]])


def test_default_chain_matches_a_transformers_processor_list(real_logits, rows):
    prompt, outputs = outputs_from(real_logits)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=0)
    ours = Sampler(rows.shape[1], CPU).processed_logits(rows, seqs_for(params, prompt, outputs))
    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8),
                                 TopKLogitsWarper(50), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)])
    theirs = torch.stack([chain(torch.tensor([prompt + outputs[i]]), rows[i:i + 1].clone())[0] for i in range(8)])
    assert_same(ours, theirs)
