"""The Sampler on hand-made logits: chains, masks, penalties kept on the device, determinism."""

from __future__ import annotations

import math

import pytest
import torch

from model_worker.sampling import Sampler
from model_worker.sampling.batch import SamplingBatch
from model_worker.sampling.counter_random import column_counters, row_keys, uniforms
from model_worker.sequence import LogprobsMode, SamplerOrder, SamplingParams, Sequence

CPU = torch.device("cpu")


def seq(seq_id: int, params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        stops: frozenset[int] = frozenset(), sample_index: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=list(prompt or [0]), sampling=params, max_tokens=100,
                    stop_token_ids=stops, output_token_ids=list(output or []), sample_index=sample_index)


def run(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], steps: int = 1) -> list[list[int]]:
    """Samples `steps` times from the same logits, appending each token as the engine does."""
    tokens = []
    for _ in range(steps):
        out = sampler.sample(logits, seqs)
        ids = out.token_ids.tolist()
        for s, t in zip(seqs, ids, strict=True):
            s.output_token_ids.append(t)
        tokens.append(ids)
    return tokens


def test_greedy_picks_argmax_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    params = SamplingParams(logprobs=True, top_logprobs=2)
    sampler = Sampler(3, CPU)
    out = sampler.sample(logits, [seq(0, params), seq(1, params)])
    assert sampler.batch.fast_greedy
    assert out.token_ids.tolist() == [1, 0]
    expected = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, expected.gather(-1, out.token_ids[:, None])[:, 0])
    assert torch.equal(out.logprobs, out.raw_logprobs)
    assert out.top_token_ids.tolist() == [[1, 2], [0, 1]]


def test_greedy_without_logprobs_computes_none():
    out = Sampler(3, CPU).sample(torch.tensor([[0.0, 3.0, 1.0]]), [seq(0, SamplingParams())])
    assert out.logprobs is None and out.top_token_ids is None


def test_sampling_follows_probabilities_and_respects_top_k():
    rows = 4000
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]])).repeat(rows, 1)
    seqs = [seq(i, SamplingParams(temperature=1.0, top_k=3, seed=i)) for i in range(rows)]
    out = Sampler(4, CPU).sample(logits, seqs)
    freq = torch.bincount(out.token_ids, minlength=4).float() / rows
    assert freq[3] == 0
    assert abs(freq[0] - 0.6) < 0.04 and abs(freq[1] - 0.3) < 0.04 and abs(freq[2] - 0.1) < 0.03


def test_one_seed_draws_the_same_over_steps_as_over_rows():
    """The draw at output position t is keyed by (seed, sample index, t): a sequence's t-th token
    does not depend on the steps of others, and different positions give different draws."""
    logits = torch.zeros(1, 1000)  # uniform: the token is the draw itself
    a = seq(0, SamplingParams(temperature=1.0, seed=7))
    tokens = [t[0] for t in run(Sampler(1000, CPU), logits, [a], steps=20)]
    assert len(set(tokens)) > 15
    b = seq(5, SamplingParams(temperature=1.0, seed=7), output=[1] * 3)  # already at position 3
    assert Sampler(1000, CPU).sample(logits, [b]).token_ids.item() == tokens[3]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    """Same row of logits alone and amid others of other params: the same tokens and bitwise the
    same logprobs (raw and processed) at every step."""
    torch.manual_seed(1)
    logits = torch.randn(5, 100)
    for mode in LogprobsMode:
        seeded = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=42, logprobs=True,
                                top_logprobs=3, logprobs_mode=mode)
        alone_seq, alone_sampler = seq(0, seeded), Sampler(100, CPU)
        others = [seq(10 + i, SamplingParams(temperature=1.0, top_k=5, seed=i, dry_multiplier=0.5)) for i in range(3)]
        others.append(seq(20, SamplingParams()))  # a greedy row too
        mixed_seq, mixed_sampler = seq(99, seeded), Sampler(100, CPU)
        mixed_seqs = others[:2] + [mixed_seq] + others[2:]
        for _ in range(6):
            a = alone_sampler.sample(logits[2:3], [alone_seq])
            m = mixed_sampler.sample(logits, mixed_seqs)
            assert a.token_ids[0] == m.token_ids[2]
            assert torch.equal(a.logprobs[0], m.logprobs[2]) and torch.equal(a.top_logprobs[0], m.top_logprobs[2])
            for s_, t in zip(mixed_seqs, m.token_ids.tolist(), strict=True):
                s_.output_token_ids.append(t)
            alone_seq.output_token_ids.append(a.token_ids.item())


def test_sample_index_gives_forks_their_own_draws():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=3)
    first = run(Sampler(1000, CPU), logits.repeat(2, 1), [seq(0, params), seq(1, params, sample_index=1)], 8)
    again = run(Sampler(1000, CPU), logits, [seq(5, params, sample_index=1)], 8)
    assert [t[0] for t in first] != [t[1] for t in first]
    assert [t[1] for t in first] == [t[0] for t in again]


def test_counter_based_uniforms_look_uniform_and_differ_by_key():
    keys = row_keys(torch.tensor([1, 1, 2]), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 0]),
                    torch.tensor([0, 0, 0]), stream=0)
    u = uniforms(keys, column_counters(50000, CPU))  # [3, 50000]
    assert len(set(keys.tolist())) == 3
    assert ((u > 0) & (u < 1)).all()
    for row in u:
        assert abs(row.mean().item() - 0.5) < 0.01
        counts = torch.histc(row, bins=20, min=0, max=1)
        chi2 = ((counts - 2500) ** 2 / 2500).sum().item()
        assert chi2 < 50  # 19 degrees of freedom: 50 is far in the tail
    assert (u[0] - u[1]).abs().mean() > 0.2


def test_penalty_counts_are_updated_in_place_and_match_a_rebuild():
    vocab = 50
    params = SamplingParams(temperature=1.0, seed=1, presence_penalty=0.5, frequency_penalty=0.5,
                            repetition_penalty=1.3, repeat_penalty=1.2, penalty_last_n=4, dry_multiplier=0.8)
    seqs = [seq(0, params, prompt=[1, 2, 3, 4, 5, 6]), seq(1, params, prompt=[7, 7, 8])]
    sampler = Sampler(vocab, CPU)
    torch.manual_seed(0)
    logits = torch.randn(2, vocab)
    run(sampler, logits, seqs, steps=1)
    batch = sampler.batch
    counts_tensor = batch.state.output_counts
    run(sampler, logits, seqs, steps=12)
    assert sampler.batch is batch and batch.state.output_counts is counts_tensor  # not rebuilt
    fresh = SamplingBatch.build(seqs, vocab, CPU, None, {})
    for name in ("output_counts", "seen", "window_counts"):
        assert torch.equal(getattr(batch.state, name), getattr(fresh.state, name)), name
    assert batch.state.num_output.tolist() == [13, 13]


def test_a_changed_batch_keeps_the_rows_that_stay():
    vocab = 30
    params = SamplingParams(temperature=1.0, seed=2, frequency_penalty=1.0)
    a, b, c = seq(0, params, prompt=[1]), seq(1, params, prompt=[2]), seq(2, params, prompt=[3])
    sampler = Sampler(vocab, CPU)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    run(sampler, logits[:2], [a, b], steps=5)
    run(sampler, logits[[1, 2]], [b, c], steps=3)  # a left, c joined
    fresh = SamplingBatch.build([b, c], vocab, CPU, None, {})
    assert torch.equal(sampler.batch.state.output_counts, fresh.state.output_counts)


def test_presence_frequency_penalise_output_tokens_only():
    logits = torch.zeros(1, 5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logprobs=True,
                            logprobs_mode=LogprobsMode.PROCESSED)
    s = seq(0, params, prompt=[4, 4], output=[1, 1, 2])
    out = Sampler(5, CPU).sample(logits, [s])
    expected = torch.tensor([[0.0, -1.0, -0.75, 0.0, 0.0]])
    assert out.token_ids.item() == 0
    assert math.isclose(out.logprobs.item(), expected.log_softmax(-1)[0, 0].item(), rel_tol=1e-6)


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0]])  # token 1 (the stop id) is the argmax
    params = SamplingParams(min_tokens=2)
    s = seq(0, params, stops=frozenset({1}))
    assert [t[0] for t in run(Sampler(3, CPU), logits, [s], steps=3)] == [2, 2, 1]


def test_bad_words_single_and_multi_token():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(bad_words=((3,), (1, 2)))
    s = seq(0, params, output=[1])
    assert Sampler(4, CPU).sample(logits, [s]).token_ids.item() == 1  # 3 banned, 2 banned after 1
    s2 = seq(1, params, output=[2])
    assert Sampler(4, CPU).sample(logits, [s2]).token_ids.item() == 2


def test_allowed_token_ids_and_logit_bias():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    seqs = [seq(0, SamplingParams(allowed_token_ids=(0, 1))), seq(1, SamplingParams(logit_bias=((0, 10.0),)))]
    assert Sampler(4, CPU).sample(logits, seqs).token_ids.tolist() == [1, 0]


def test_structured_output_bitmask_hook():
    logits = torch.arange(40, dtype=torch.float32)[None, :]  # V = 40: two 32-bit words
    bitmask = torch.tensor([[0b0100, 1 << 2]], dtype=torch.int32)  # allows tokens 2 and 34
    out = Sampler(40, CPU).sample(logits, [seq(0, SamplingParams())], allowed_token_bitmask=bitmask)
    assert out.token_ids.item() == 34
    sampled = Sampler(40, CPU).sample(logits.repeat(64, 1), [seq(i, SamplingParams(temperature=100.0, seed=i))
                                                            for i in range(64)],
                                      allowed_token_bitmask=bitmask.repeat(64, 1))
    assert set(sampled.token_ids.tolist()) == {2, 34}
    unconstrained = torch.full((1, 2), -1, dtype=torch.int32)
    out = Sampler(40, CPU).sample(logits, [seq(1, SamplingParams())], allowed_token_bitmask=unconstrained)
    assert out.token_ids.item() == 39


def test_raw_logprobs_are_over_the_tokens_the_grammar_allows():
    # vLLM V1 masks the logits with the grammar before its sampler: a guided choice between two
    # tokens reads its chosen token's probability among those two, and no forbidden alternative.
    logits = torch.arange(40, dtype=torch.float32)[None, :].repeat(2, 1)
    bitmask = torch.tensor([[0b0100, 1 << 2], [0, 0]], dtype=torch.int32)  # row 0: tokens 2 and 34; row 1: none
    params = SamplingParams(logprobs=True, top_logprobs=3)
    out = Sampler(40, CPU).sample(logits.clone(), [seq(0, params), seq(1, params)], allowed_token_bitmask=bitmask)
    assert out.token_ids[0].item() == 34
    expected = -math.log1p(math.exp(2.0 - 34.0))
    assert out.logprobs[0].item() == pytest.approx(expected, abs=1e-6) == out.raw_logprobs[0].item()
    assert out.top_token_ids[0, :2].tolist() == [34, 2] and out.top_logprobs[0, 2].item() == float("-inf")
    # A row the grammar leaves empty (a parser in error) keeps finite logprobs; its matcher ends it.
    assert out.token_ids[1].item() == 39 and math.isfinite(out.logprobs[1].item())


def test_processed_logprobs_follow_the_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_k=2, seed=0, logprobs=True, top_logprobs=4,
                            logprobs_mode=LogprobsMode.PROCESSED)
    raw = SamplingParams(temperature=1.0, top_k=2, seed=0, logprobs=True, top_logprobs=4)
    out = Sampler(4, CPU).sample(logits.repeat(2, 1), [seq(0, params), seq(1, raw)])
    processed_top = out.top_logprobs[0].tolist()
    assert math.isclose(math.exp(processed_top[0]), 0.5 / 0.8, rel_tol=1e-5)
    assert processed_top[2:] == [float("-inf")] * 2
    assert torch.allclose(out.top_logprobs[1], logits[0].sort(descending=True).values)
    assert out.raw_logprobs[0] == out.raw_logprobs[1] or out.token_ids[0] != out.token_ids[1]


def test_temperature_order_differs_between_chains():
    """min_p 0.5 with temperature 0.25 on p = (0.5, 0.3, 0.2): the default chain sharpens first, so
    min_p sees (0.87, 0.11, 0.02) and keeps one token; llama.cpp filters the raw p first and keeps
    0.5 and 0.3 (>= 0.25), then applies the temperature."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    base = {"temperature": 0.25, "min_p": 0.5, "seed": 0, "logprobs": True, "top_logprobs": 3,
            "logprobs_mode": LogprobsMode.PROCESSED}
    default = SamplingParams(**base)
    llama = SamplingParams(**base, sampler_order=SamplerOrder.LLAMA_CPP)
    out = Sampler(3, CPU).sample(logits.repeat(2, 1), [seq(0, default), seq(1, llama)])
    kept_default = torch.isfinite(out.top_logprobs[0]).sum().item()
    kept_llama = torch.isfinite(out.top_logprobs[1]).sum().item()
    assert (kept_default, kept_llama) == (1, 2)


def test_mixed_order_batch_equals_separate_batches():
    torch.manual_seed(3)
    logits = torch.randn(4, 64)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=i,
                             sampler_order=SamplerOrder(i % 2), logprobs=True,
                             logprobs_mode=LogprobsMode.PROCESSED) for i in range(4)]
    together = Sampler(64, CPU).sample(logits, [seq(i, p) for i, p in enumerate(params)])
    for i, p in enumerate(params):
        alone = Sampler(64, CPU).sample(logits[i:i + 1], [seq(i, p)])
        assert alone.token_ids.item() == together.token_ids[i].item()
        assert torch.allclose(alone.logprobs, together.logprobs[i:i + 1])


def test_mirostat_v2_truncates_and_moves_mu_towards_tau():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))
    params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=1.0, mirostat_eta=0.5, seed=4)
    sampler = Sampler(5, CPU)
    s = seq(0, params)
    run(sampler, logits, [s], steps=1)
    mu = sampler.batch.mirostat_mu.item()
    # mu starts at 2 * tau = 2 bits: only tokens with surprise <= 2 (p >= 0.25) survive, so the draw
    # is token 0 or 1; the observed surprise is measured in the renormalised (0.5, 0.25) / 0.75.
    chosen = s.output_token_ids[0]
    assert chosen in (0, 1)
    observed = -math.log2([0.5, 0.25][chosen] / 0.75)
    assert math.isclose(mu, 2.0 - 0.5 * (observed - 1.0), rel_tol=1e-5)


def test_xtc_coin_is_seeded():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    params = SamplingParams(temperature=1.0, xtc_threshold=0.1, xtc_probability=0.5, seed=11)
    first = run(Sampler(4, CPU), logits, [seq(0, params)], steps=30)
    second = run(Sampler(4, CPU), logits, [seq(1, params)], steps=30)
    assert first == second
    # When the coin comes up only token 3 survives; it does about half the time, plus its own 10%.
    share = sum(t[0] == 3 for t in first) / 30
    assert 0.2 < share < 0.9


def test_mix32_is_lowbias32_on_int32_bit_patterns():
    from model_worker.sampling.counter_random import mix32

    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    got = mix32(torch.tensor(values, dtype=torch.long).to(torch.int32)).long() & 0xFFFFFFFF
    assert got.tolist() == [reference(v) for v in values]


def test_dry_and_repeat_penalty_through_the_sampler_match_llama_cpp():
    """llama.cpp's test_dry case {0, 1, 2, 0, 1} -> (0.296923, 0.296923, 0.109232, 0.296923), here
    with the tokens split between prompt and output and the history kept on the device; and its
    repeat-penalty case ({0, 1, 2}, penalty 50) over a window that slid past older tokens."""
    logits = torch.log(torch.full((1, 4), 0.25))
    dry = SamplingParams(dry_multiplier=1.0, dry_base=1.1, dry_allowed_length=2, dry_penalty_last_n=5,
                         logprobs=True, top_logprobs=4, logprobs_mode=LogprobsMode.PROCESSED)
    s = seq(0, dry, prompt=[3, 3, 0, 1, 2], output=[0, 1])  # the window holds the last 5: 0 1 2 0 1
    probs = Sampler(4, CPU).processed_logits(logits, [s]).softmax(-1)[0].tolist()
    assert probs == pytest.approx([0.296923, 0.296923, 0.109232, 0.296923], abs=1e-5)

    five = torch.log(torch.full((1, 5), 0.2))
    repeat = SamplingParams(repeat_penalty=50.0, penalty_last_n=3)
    sampler = Sampler(5, CPU)
    s = seq(1, repeat, prompt=[3, 4, 0], output=[])
    run(sampler, torch.tensor([[0.0, 9.0, 0.0, 0.0, 0.0]]), [s])  # draws 1: window 4 0 1
    run(sampler, torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0]]), [s])  # draws 2: window 0 1 2, 4 left
    probs = sampler.processed_logits(five, [s]).softmax(-1)[0].tolist()
    assert probs == pytest.approx([0, 0, 0, 0.5, 0.5], abs=1e-5)


def test_filters_after_top_k_sort_only_the_candidates_with_the_same_result():
    """top_p and typical_p sort only the tokens still in play when an earlier top_k left few; the
    kept sets must equal those of the full-vocabulary sort (checked against HF in the parity test)."""
    from model_worker.sampling import processors

    torch.manual_seed(5)
    logits = torch.randn(6, 4000) * 3
    k = torch.tensor([[5], [40], [200], [900], [1], [77]])
    narrowed = processors.top_k(logits, k, 900)  # at most 900 <= 4000 / 4 candidates per row
    p = torch.tensor([[0.3], [0.6], [0.9], [0.95], [0.5], [0.99]], dtype=torch.float64)
    full_sort = narrowed.clamp(min=-1e30)  # every token finite (probability 0): forces the full sort
    for fn, arg in ((processors.top_p_removed, p), (processors.typical_p_removed, p.float())):
        fast = fn(narrowed, arg) | ~torch.isfinite(narrowed)
        full = fn(full_sort, arg) | ~torch.isfinite(narrowed)
        assert torch.equal(fast, full)
        assert (~fast).sum(-1).min() >= 1


def test_top_p_settled_from_a_few_tokens_keeps_what_the_full_sort_keeps(monkeypatch):
    """On CPU top_p looks for each row's cut among its largest logits, then within a band of logit
    values, and sorts the whole row only when neither settles it. Peaked and flat rows, exact
    ties, -inf runs and p 1 (off) rows side by side: each row keeps what the full sort keeps, but
    for a token whose cumulative mass is within float32 rounding of 1 - p (the softmax's sum runs
    in another order), and every path ran."""
    from model_worker.sampling import processors

    settled_by: dict[str, int] = {"full sort": 0}
    full_sort = processors._top_p_removed_by_full_sort

    def counting_full_sort(logits, p):
        settled_by["full sort"] += logits.shape[0]
        return full_sort(logits, p)

    def counting(settle):
        def counted(*args):
            remove, settled = settle(*args)
            settled_by[settle.__name__] = settled_by.get(settle.__name__, 0) + int(settled.sum())
            return remove, settled
        return counted

    monkeypatch.setattr(processors, "_top_p_removed_by_full_sort", counting_full_sort)
    for name in ("_top_p_removed_among_largest", "_top_p_removed_in_band"):
        monkeypatch.setattr(processors, name, counting(getattr(processors, name)))
    torch.manual_seed(3)
    vocab = 5000
    scales = torch.tensor([[12.0], [8.0], [4.0], [2.0], [1.0], [0.3], [6.0], [3.0], [0.0]])
    for trial in range(16):
        logits = torch.randn(9, vocab) * scales
        logits[1] = (logits[1] * 2).round() / 2  # many exact ties
        logits[6, : vocab // 2] = float("-inf")
        logits[7, torch.randperm(vocab)[:100]] = 20.0  # 100 tokens tie across the top-64
        logits[8, 0] = 1e-3  # all but one tied: the band cannot narrow it
        p = torch.rand(9, 1, dtype=torch.float64) * 0.98 + 0.01
        p[0] = 1 - 1e-9  # the band's float32 histogram does not place such a cut: the full sort
        p[trial % 9] = 1.0
        expected = full_sort(logits, p)
        ours = processors.top_p_removed(logits, p)
        assert not ours[trial % 9].any()  # p 1 keeps the whole row
        for row, token in (ours != expected).nonzero().tolist():  # only at the cut, by rounding
            descending, order = logits[row].sort(descending=True, stable=True)  # the full sort's order
            ascending, order = descending.flip(-1), order.flip(-1)
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)[(order == token).nonzero()[0, 0]]
            assert abs(cumulative.item() - (1 - p[row].item())) < 1e-5, (trial, row, token)
    assert min(settled_by.values()) > 0, settled_by
    assert set(settled_by) == {"full sort", "_top_p_removed_among_largest", "_top_p_removed_in_band"}


def test_top_p_rows_the_cheaper_paths_cannot_settle_go_to_the_full_sort():
    """Rows that once crashed the band: p so close to 1 that the float32 histogram never reaches
    it (an empty band), all-equal and nearly flat rows (a band of the whole row), and rows with
    +inf, NaN or only -inf (NaN bins). Beside ordinary rows, each keeps what the full sort keeps."""
    from model_worker.sampling import processors

    torch.manual_seed(4)
    logits = torch.randn(8, 4000) * 3
    logits[1] = 0.0  # all equal
    logits[2] = torch.randn(4000) * 0.001  # nearly flat
    logits[3, 17] = float("inf")
    logits[4, 99] = float("nan")
    logits[5] = float("-inf")
    p = torch.tensor([[0.99999999], [0.9999], [0.9], [0.9], [0.9], [0.9], [0.9], [0.5]], dtype=torch.float64)
    for rows in ([0], [1], [0, 1, 6, 7], list(range(8))):
        ours = processors.top_p_removed(logits[rows], p[rows])
        assert torch.equal(ours, processors._top_p_removed_by_full_sort(logits[rows], p[rows])), rows


def test_top_p_keeps_the_same_tied_token_whichever_path_the_batch_takes():
    # Tokens 3 and 40 tie at the top; top_k=2 then top_p=0.5 keeps one of them. Alone, the row
    # takes top_p's candidates-only path; beside a row without top_k, the full sort. Both keep
    # the lowest id, as transformers does here and as argmax would.
    logits = torch.full((64,), -5.0)
    logits[3] = logits[40] = 2.0
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
    for seed in range(4):
        tied = SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=seed)
        alone = Sampler(64, CPU).sample(logits[None].clone(), [seq(0, tied)]).token_ids.tolist()
        shared = Sampler(64, CPU).sample(torch.stack([logits, logits]), [seq(0, tied), seq(1, other)]).token_ids
        assert alone == [3] and shared[0].item() == 3


def test_a_row_without_a_penalty_window_beside_one_with_it_runs_past_the_history_width():
    # Rows without repeat_penalty (or with penalty_last_n -1) have no window; their "leaving"
    # position is one past their length, which once indexed past the history tensor.
    torch.manual_seed(0)
    windowed = seq(0, SamplingParams(temperature=0.7, repeat_penalty=1.1, seed=1), prompt=[1] * 8)
    plain = seq(1, SamplingParams(temperature=0.7, seed=2), prompt=[2] * 62)
    whole_context = seq(2, SamplingParams(temperature=0.7, repeat_penalty=1.1, penalty_last_n=-1,
                                          dry_multiplier=0.8, seed=3), prompt=[1] * 62)
    sampler = Sampler(100, CPU)
    for _ in range(6):
        seqs = [windowed, plain, whole_context]
        for s, t in zip(seqs, sampler.sample(torch.randn(3, 100), seqs).token_ids.tolist(), strict=True):
            s.output_token_ids.append(t)
    assert all(len(s.output_token_ids) == 6 for s in seqs)


def test_a_tiny_positive_temperature_is_greedy():
    # logits / 1e-39 overflows float32 to inf for every positive logit (and 1e-46 rounds to 0).
    logits = torch.tensor([[0.5, 3.0, -1.0, 0.0, 2.0]])
    for temperature in (1e-6, 1e-39, 1e-46):
        params = SamplingParams(temperature=temperature, seed=0)
        assert params.greedy
        assert Sampler(5, CPU).sample(logits.clone(), [seq(0, params)]).token_ids.tolist() == [1]
    assert not SamplingParams(temperature=1e-5).greedy


# ---------------------------------------------------------------- sampler output to the host


def _sampler_output(device: str):
    from model_worker.sampling.sampler import SamplerOutput
    return SamplerOutput(
        token_ids=torch.tensor([3, 1, 4], device=device),
        logprobs=torch.tensor([-0.5, -1.0, -2.0], device=device),
        raw_logprobs=torch.tensor([-0.25, -1.5, -2.5], device=device),
        top_token_ids=torch.tensor([[3, 2], [1, 0], [4, 5]], device=device),
        top_logprobs=torch.tensor([[-0.5, -1.0], [-1.0, -2.0], [-2.0, -3.0]], device=device),
    )


def test_sampler_output_on_the_cpu_goes_to_the_host_as_it_is():
    out = _sampler_output("cpu")
    assert out.to_host() is out


@pytest.mark.gpu
def test_sampler_output_reaches_the_host_with_one_sync():
    """Five tensors, one wait: a .tolist() of each device tensor would sync five times."""
    import warnings
    out = _sampler_output("cuda")
    expected = _sampler_output("cpu")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            host = out.to_host()
            lists = [t.tolist() for t in (host.token_ids, host.logprobs, host.raw_logprobs, host.top_token_ids,
                                          host.top_logprobs)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
    assert lists == [t.tolist() for t in (expected.token_ids, expected.logprobs, expected.raw_logprobs,
                                          expected.top_token_ids, expected.top_logprobs)]


def test_penalties_at_seen_tokens_only_match_the_dense_formulas():
    """The repetition and presence/frequency penalties touch only the tokens a row has seen; the
    values must equal the dense torch.where formulas bit for bit, rows of other penalties alike."""
    from model_worker.sampling import penalties

    torch.manual_seed(6)
    logits = torch.randn(5, 3000) * 4
    counts = torch.zeros(5, 3000)
    counts[torch.randint(0, 5, (400,)), torch.randint(0, 3000, (400,))] += 1.0
    counts[2] = 0.0  # a row that has seen nothing
    penalty = torch.tensor([[1.1], [0.8], [1.5], [1.0], [2.0]])
    presence, frequency = torch.tensor([[0.5], [-1.0], [2.0], [0.0], [0.3]]), torch.tensor([[0.2], [0.0], [1.0], [-0.5], [0.7]])

    dense_repetition = torch.where(counts > 0, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    dense_presence = logits - torch.where(counts > 0, counts * frequency + presence, 0.0)
    # On a GPU they run dense (no nonzero() host sync): the same values there.
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        on = {name: t.to(device) for name, t in dict(logits=logits, counts=counts, penalty=penalty, presence=presence,
                                                     frequency=frequency).items()}
        repetition = penalties.apply_sign_aware_penalty(on["logits"].clone(), on["counts"] > 0, on["penalty"])
        presence_frequency = penalties.apply_presence_frequency(on["logits"].clone(), on["counts"], on["presence"],
                                                                on["frequency"])
        assert torch.equal(repetition.cpu(), dense_repetition), device
        assert torch.equal(presence_frequency.cpu(), dense_presence), device
    assert not torch.equal(dense_repetition, logits) and torch.equal(dense_repetition[2], logits[2])
