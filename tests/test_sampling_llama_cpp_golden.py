"""Golden cases for the llama.cpp chain and penalty formulas, transcribed from llama.cpp's own
tests/test-sampling.cpp (ggml-org/llama.cpp): same input probabilities, same parameters, same
expected probabilities (llama.cpp checks them to 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch

from model_worker.sampling import penalties, processors

NEG_INF = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    """[1, V]: llama.cpp's sampler_tester builds logit = logf(p)."""
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def kept_probs(logits: torch.Tensor) -> list[float]:
    """Probabilities of the surviving tokens after renormalising, most likely first (llama.cpp's
    filters leave the survivors sorted; its dist sampler renormalises)."""
    probs = logits.softmax(dim=-1)[0]
    return sorted((p for p in probs.tolist() if p > 0), reverse=True)


def assert_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected, strict=True):
        assert abs(a - e) < 1e-5, (actual, expected)


def col(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([[value]], dtype=dtype)


def test_temperature():
    # llama.cpp: temp 1 keeps the distribution; temp 0 is greedy, which here is the greedy path
    # (argmax of the penalised logits), so only the temp-1 case applies to the warper itself.
    out = processors.apply_temperature(logits_of([0.1, 0.2, 0.3, 0.4]), col(1.0))
    assert_close(kept_probs(out), [0.4, 0.3, 0.2, 0.1])
    sharper = processors.apply_temperature(logits_of([0.1, 0.2, 0.3, 0.4]), col(0.5))
    assert_close(kept_probs(sharper), [p * p / 0.3 for p in (0.4, 0.3, 0.2, 0.1)])


@pytest.mark.parametrize(("k", "expected"), [
    (1, [1.0]),
    (3, [0.44444, 0.33333, 0.22222]),
    (4, [0.4, 0.3, 0.2, 0.1]),
    (0, [0.4, 0.3, 0.2, 0.1]),
])
def test_top_k(k, expected):
    out = processors.top_k(logits_of([0.1, 0.2, 0.3, 0.4]), col(k, torch.long), max(k, 1))
    assert_close(kept_probs(out), expected)


@pytest.mark.parametrize(("p", "expected"), [
    (0.0, [1.0]),
    (0.7, [0.571429, 0.428571]),
    (0.8, [0.44444, 0.33333, 0.22222]),
    (1.0, [0.4, 0.3, 0.2, 0.1]),
])
def test_top_p(p, expected):
    assert_close(kept_probs(processors.top_p(logits_of([0.1, 0.2, 0.3, 0.4]), col(p))), expected)


@pytest.mark.parametrize(("p", "expected"), [
    (0.00, [0.4, 0.3, 0.2, 0.1]),
    (0.24, [0.4, 0.3, 0.2, 0.1]),
    (0.26, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9]),
    (0.49, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9]),
    (0.51, [0.4 / 0.7, 0.3 / 0.7]),
    (0.74, [0.4 / 0.7, 0.3 / 0.7]),
    (0.76, [1.0]),
    (1.00, [1.0]),
    (1.05, [1.0]),
])
def test_min_p(p, expected):
    assert_close(kept_probs(processors.min_p(logits_of([0.1, 0.2, 0.3, 0.4]), col(p))), expected)


@pytest.mark.parametrize(("threshold", "kept"), [
    (0.09, [0.1]),
    (0.19, [0.2, 0.1]),
    (0.29, [0.3, 0.2, 0.1]),
    (0.39, [0.4, 0.3, 0.2, 0.1]),  # "XTC should not": only one token above the threshold
])
def test_xtc(threshold, kept):
    # llama.cpp runs these with probability 0.99 and a seeded coin that comes up; our coin is an
    # argument, so the case is "the coin came up". llama.cpp checks the raw probabilities of the
    # survivors (no dist sampler after XTC), so the expectation is renormalised here.
    out = processors.xtc(logits_of([0.4, 0.3, 0.2, 0.1]), col(threshold), torch.tensor([[True]]))
    total = sum(kept)
    assert_close(kept_probs(out), [p / total for p in kept])


def test_xtc_does_nothing_when_the_coin_does_not_come_up():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert torch.equal(processors.xtc(logits, col(0.09), torch.tensor([[False]])), logits)


@pytest.mark.parametrize(("probs", "kept", "mass"), [
    ([0.97, 0.01, 0.01, 0.01], [0.97], 0.5),
    ([0.4, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2], 0.5),
])
def test_typical(probs, kept, mass):
    # No dist sampler after typical in llama.cpp's test: it checks the survivors' raw probabilities.
    total = sum(kept)
    assert_close(kept_probs(processors.typical_p(logits_of(probs), col(mass))), [p / total for p in kept])


@pytest.mark.parametrize(("n", "expected"), [
    (1.0, [0.571429, 0.428571]),
    (0.0, [0.4, 0.3, 0.2, 0.1]),  # 0 is a no-op (llama.cpp PR #13345)
    (3.0, [0.4, 0.3, 0.2, 0.1]),
])
def test_top_n_sigma(n, expected):
    assert_close(kept_probs(processors.top_n_sigma(logits_of([0.1, 0.2, 0.3, 0.4]), col(n))), expected)


def counts_of(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab)[None, :]


@pytest.mark.parametrize(("last_tokens", "expected"), [
    ([0], [0, 0.25, 0.25, 0.25, 0.25]),
    ([0, 1, 2], [0, 0, 0, 0.5, 0.5]),
    ([0, 1, 2, 0, 0], [0, 0, 0, 0.5, 0.5]),
])
def test_repeat_penalty(last_tokens, expected):
    logits = logits_of([0.2] * 5)
    out = penalties.apply_sign_aware_penalty(logits, counts_of(last_tokens, 5) > 0, col(50.0))
    assert_close(out.softmax(-1)[0].tolist(), expected)


@pytest.mark.parametrize(("last_tokens", "expected"), [
    ([0], [0.000011, 0.249997, 0.249997, 0.249997, 0.249997]),
    ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966]),
    ([0, 1, 2, 0, 0], [0.000000, 0.000023, 0.000023, 0.499977, 0.499977]),
])
def test_frequency_and_presence_penalties(last_tokens, expected):
    logits = logits_of([0.2] * 5)
    out = penalties.apply_presence_frequency(logits, counts_of(last_tokens, 5), col(5.0), col(5.0))
    assert_close(out.softmax(-1)[0].tolist(), expected)


def dry(probs, last_tokens, multiplier, base, allowed_length, last_n, breakers) -> list[float]:
    window_tokens = last_tokens[-last_n:]
    window = torch.tensor([window_tokens])
    valid = torch.ones_like(window, dtype=torch.bool)
    width = max((len(b) for b in breakers), default=0)
    packed = torch.full((1, len(breakers), width), -1, dtype=torch.long)
    for i, b in enumerate(breakers):
        packed[0, i, :len(b)] = torch.tensor(b)
    rep_limit = penalties.dry_rep_limit(window, valid, packed)
    max_exp = penalties.dry_max_exponent(base)
    singles = torch.tensor([[b[0] for b in breakers if len(b) == 1] or [-1]])
    ids, amounts = penalties.dry_penalties(window, valid, rep_limit, torch.tensor([multiplier]),
                                           torch.tensor([base]), torch.tensor([allowed_length]),
                                           torch.tensor([max_exp]), singles, allowed_length + max_exp, len(probs))
    return penalties.subtract_at(logits_of(probs), ids, amounts).softmax(-1)[0].tolist()


@pytest.mark.parametrize(("probs", "last_tokens", "expected", "multiplier", "base", "allowed", "last_n", "breakers"), [
    ([0.25] * 4, [0, 1], [0.25, 0.25, 0.25, 0.25], 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
])
def test_dry(probs, last_tokens, expected, multiplier, base, allowed, last_n, breakers):
    assert_close(dry(probs, last_tokens, multiplier, base, allowed, last_n, breakers), expected)


def test_dry_longer_repeat_grows_the_penalty_and_breakers_cut_it():
    # a b c d | a b c -> d would extend a 3-token repeat: base ** (3 - 2) * multiplier.
    probs = [0.2] * 5
    out = dry(probs, [0, 1, 2, 3, 0, 1, 2], 1.0, 2.0, 2, 7, [])
    expected_logit = math.log(0.2) - 2.0
    z = 4 * 0.2 + math.exp(expected_logit)
    assert abs(out[3] - math.exp(expected_logit) / z) < 1e-5
    # A breaker (token 1) inside the repeat limits its length to the tokens after it (1 < 2).
    assert_close(dry(probs, [0, 1, 2, 3, 0, 1, 2], 1.0, 2.0, 2, 7, [[1]]), [0.2] * 5)


def queue_expected_sizes(n_vocab: int, sequence: str, top_k: int, top_p: float, min_p: float) -> list[int]:
    """llama.cpp's test_sampler_queue expectations, step by step (logit = log(token id))."""
    sizes = []
    size = n_vocab
    min_token_id = 0
    for s in sequence:
        if s == "k":
            size = min(size, top_k)
            min_token_id = max(min_token_id, n_vocab - top_k)
        elif s == "p":
            divisor = n_vocab * (n_vocab - 1) // 2 - min_token_id * (min_token_id - 1) // 2
            target = math.ceil(top_p * divisor)
            min_token_id = n_vocab
            size = 0
            cumsum = 0
            while True:
                min_token_id -= 1
                size += 1
                cumsum += min_token_id
                if cumsum >= target:
                    break
            if min_token_id == 1:
                min_token_id -= 1
                size += 1
        elif s == "m":
            expected = max(math.ceil((1.0 - min_p) * n_vocab), 1)
            size = min(expected, size)
            min_token_id = max(math.floor(min_p * n_vocab), 1, n_vocab - size)
            min_token_id = min(min_token_id, n_vocab - 1)
        sizes.append(size)
    return sizes


@pytest.mark.parametrize(("sequence", "top_k", "top_p", "min_p"), [
    ("k", 10000, 1.0, 1.0), ("k", 1, 1.0, 1.0), ("p", 10000, 1.0, 1.0), ("p", 10000, 0.0, 1.0),
    ("m", 10000, 1.0, 1.0), ("k", 100, 1.0, 1.0), ("p", 10000, 0.0003, 1.0),
    ("p", 10000, 0.8, 1.0), ("m", 10000, 1.0, 9997.9 / 9999.0), ("m", 10000, 1.0, 0.1),
    # Orders of llama.cpp's chain (k before p before m) from its queue cases.
    ("kp", 100, 0.8, 0.1), ("km", 100, 0.8, 0.1), ("pm", 100, 0.8, 0.1), ("kpm", 100, 0.8, 0.1),
])
def test_sampler_queue(sequence, top_k, top_p, min_p):
    n_vocab = 10000
    # llama.cpp's token 0 has logit log(0) = -inf but still counts as a candidate until a filter
    # drops it; ours marks dropped tokens with -inf, so token 0 gets a finite logit that is
    # still negligible (1e-30 against the next id's 1). (llama.cpp's case "m" with min_p 1e-12
    # keeps that zero-probability token; our min_p drops it, so that one case is left out.)
    logits = torch.log(torch.arange(n_vocab, dtype=torch.float32).clamp(min=1e-30))[None, :]
    sizes = []
    for s in sequence:
        if s == "k":
            logits = processors.top_k(logits, col(top_k, torch.long), top_k)
        elif s == "p":
            logits = processors.top_p(logits, col(top_p))
        else:
            logits = processors.min_p(logits, col(min_p))
        sizes.append(int(torch.isfinite(logits).sum()))
    assert sizes == queue_expected_sizes(n_vocab, sequence, top_k, top_p, min_p)


def test_xtc_ignores_tokens_already_filtered_out():
    logits = processors.top_k(logits_of([0.4, 0.3, 0.2, 0.1]), col(3, torch.long), 3)
    out = processors.xtc(logits, col(0.0), torch.tensor([[True]]))
    assert torch.isfinite(out).tolist() == [[False, False, True, False]]  # the least likely survivor
