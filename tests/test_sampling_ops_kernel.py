"""The sampler's compiled ops (model_worker/kernels/sampling_ops.cpp) against torch: the greedy
argmax against torch.argmax, the sampled draw against argmax(logits + counter_random.gumbel_noise),
top_p's cut against the full sort of processors.top_p_removed.

Skipped where it cannot be used: a CPU without AVX-512 or no C++ compiler; the sampler then runs
torch.argmax, which the rest of the suite covers. Where both are there, a kernel that fails to
build fails these tests instead of skipping them.
"""

from __future__ import annotations

import pytest
import torch

from model_worker import kernels
from model_worker.sampling import processors
from model_worker.sampling.counter_random import column_counters, gumbel_noise
from model_worker.sampling.sampler import Sampler
from model_worker.sequence import SamplingParams, Sequence

CAN_BUILD = kernels.can_build({"avx512f"})
module = kernels.sampling_ops_module()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no AVX-512 CPU or no C++ compiler here")
INF, NAN = float("inf"), float("nan")


def test_the_kernel_builds_where_it_can():
    assert (module is not None) == CAN_BUILD


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 151936])
@pytest.mark.parametrize("rows", [0, 1, 3, 33])
def test_random_rows_match_torch(vocab, rows):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + rows))
    assert torch.equal(module.argmax_rows(logits), logits.argmax(dim=-1))


@needs_kernel
def test_ties_nan_and_infinities_as_torch_answers():
    cases = [
        [1.0, 3.0, 3.0, 2.0],  # a tie: the first
        [3.0] * 40,  # all equal, across lanes and chunks: 0
        [-INF] * 20,  # nothing above -inf: 0
        [0.0] * 17 + [5.0] + [0.0] * 30 + [5.0],  # the same max in two lanes: the smaller index
        [1.0, NAN, 7.0, NAN],  # NaN counts as the largest: the first NaN
        [9.0] * 33 + [NAN],  # a NaN in the masked tail
        [1.0, INF, 2.0, INF],
        [-0.0, 0.0],  # equal under comparison: the first
        [-INF, -3.0e38, -INF],
    ]
    width = max(len(c) for c in cases)
    for case in cases:
        row = torch.tensor([case])
        assert module.argmax_rows(row).item() == row.argmax(dim=-1).item(), case
    # The same rows padded into one batch with -inf (which never wins), for the parallel split.
    batch = torch.full((len(cases) * 5, width), -INF)
    for i in range(batch.shape[0]):
        case = cases[i % len(cases)]
        batch[i, :len(case)] = torch.tensor(case)
    assert torch.equal(module.argmax_rows(batch), batch.argmax(dim=-1))


@needs_kernel
def test_rows_of_a_wider_tensor():
    wide = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    rows = wide[:, :64]  # strided rows, contiguous within
    assert torch.equal(module.argmax_rows(rows), rows.argmax(dim=-1))


@needs_kernel
def test_refuses_what_it_was_not_built_for():
    with pytest.raises(RuntimeError, match="float32"):
        module.argmax_rows(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="float32"):
        module.argmax_rows(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="float32"):
        module.argmax_rows(torch.randn(8))
    with pytest.raises(RuntimeError, match="V must be"):
        module.argmax_rows(torch.randn(2, 0))


def test_runner_hands_the_kernel_to_the_sampler_on_cpu(tiny_model_dir):
    from model_worker.engine import LLMEngine
    from model_worker.model_runner import ModelRunner

    def engine(**flags) -> LLMEngine:
        runner = ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.float32, 2, 64, **flags)
        return LLMEngine(runner, [], 2, 64, 4)

    with_kernel, without = engine(), engine(cpu_decode_kernel=False)
    assert (with_kernel.runner.argmax is not None) == CAN_BUILD
    assert without.runner.argmax is None
    if CAN_BUILD:
        assert with_kernel.sampler._argmax is module.argmax_rows
        assert with_kernel.sampler._gumbel_argmax is module.gumbel_argmax_rows
        assert with_kernel.sampler._top_p_removed.keywords["kernel"] is module.top_p_rows
    assert without.sampler._gumbel_argmax is None and without.sampler._top_p_removed.keywords["kernel"] is None


def test_the_sampler_falls_back_to_torch():
    sampler = Sampler(8, torch.device("cpu"))
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, NAN, 0.0, 0.0, 0.0]])
    assert sampler._argmax(logits).tolist() == [4]


def torch_draw(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return (gumbel_noise(keys, column_counters(logits.shape[1], logits.device)) + logits).argmax(dim=-1)


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 17, 49152])
@pytest.mark.parametrize("scale", [0.5, 3.0, 30.0])  # flat rows, where every token gets noise, to peaked ones
def test_gumbel_draw_matches_torch(vocab, scale):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(33, vocab, generator=gen) * scale
    keys = torch.randint(-2**31, 2**31 - 1, (33,), dtype=torch.int32, generator=gen)
    assert torch.equal(module.gumbel_argmax_rows(logits, keys, column_counters(vocab, logits.device)),
                       torch_draw(logits, keys))


@needs_kernel
def test_gumbel_draw_of_rows_torch_answers_without_noise():
    rows = [
        [-INF] * 40,  # nothing above -inf: 0
        [-INF] * 30 + [0.0] + [-INF] * 9,  # one token left (a filter's work): always it
        [1.0, NAN, 7.0, NAN],  # NaN wins: the first NaN
        [1.0, INF, 2.0, INF] * 5,  # the first +inf
        [-3.0e38, 3.0e38] * 9,  # finite extremes
    ]
    width = max(len(r) for r in rows)
    logits = torch.full((len(rows), width), -INF)
    for i, row in enumerate(rows):
        logits[i, :len(row)] = torch.tensor(row)
    for seed in range(5):
        keys = torch.arange(len(rows), dtype=torch.int32) * 7919 + seed
        assert torch.equal(module.gumbel_argmax_rows(logits, keys, column_counters(width, logits.device)),
                           torch_draw(logits, keys)), seed


@needs_kernel
def test_gumbel_draw_frequencies_follow_the_softmax():
    """The kernel's own draws, not only its agreement with torch: 20000 keys over 5 tokens."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(20000, 5).contiguous()
    keys = torch.arange(20000, dtype=torch.int32) * 2654435761 % (2**31)
    drawn = module.gumbel_argmax_rows(logits, keys.to(torch.int32), column_counters(5, logits.device))
    frequencies = torch.bincount(drawn, minlength=5).double() / 20000
    assert torch.allclose(frequencies, logits[0].double().softmax(dim=-1), atol=0.01), frequencies


@needs_kernel
def test_the_sampler_draws_on_the_kernel_as_on_torch():
    """A batch of sampled rows (and a greedy one) through the Sampler with and without the kernels."""
    vocab = 3000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2)) * 4
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((1.0, 0.7, 1.3, 1.0))] + [SamplingParams()]

    def draws(*kernel_picks) -> list[list[int]]:
        sampler = Sampler(vocab, torch.device("cpu"), *kernel_picks)
        seqs = [Sequence(seq_id=i, prompt_token_ids=[1, 2, 3], sampling=p, max_tokens=100, stop_token_ids=frozenset())
                for i, p in enumerate(params)]
        out = []
        for _ in range(8):
            ids = sampler.sample(logits, seqs).token_ids.tolist()
            for seq, token in zip(seqs, ids, strict=True):
                seq.output_token_ids.append(token)
            out.append(ids)
        return out

    with_kernels = draws(module.argmax_rows, module.gumbel_argmax_rows)
    assert with_kernels == draws()
    assert len({tuple(step[:4]) for step in with_kernels}) > 1  # the draws move from step to step


@needs_kernel
def test_gumbel_draw_refuses_what_it_was_not_built_for():
    columns = column_counters(8, torch.device("cpu"))
    keys = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="keys must be"):
        module.gumbel_argmax_rows(torch.randn(2, 8), keys.long(), columns)
    with pytest.raises(RuntimeError, match="keys must be"):
        module.gumbel_argmax_rows(torch.randn(3, 8), keys, columns)
    with pytest.raises(RuntimeError, match="columns must be"):
        module.gumbel_argmax_rows(torch.randn(2, 8), keys, columns[:4])
    with pytest.raises(RuntimeError, match="float32"):
        module.gumbel_argmax_rows(torch.randn(2, 8).double(), keys, columns)


@needs_kernel
def test_gumbel_draw_keeps_a_far_token_whose_noise_is_large_enough():
    """The kernel skips the noise of tokens too far below the best score to win: a token 14 logits
    down still wins with a large enough noise (14.1+, about one draw in 1.3 million), and must not
    be skipped. Search keys for one whose noise at a later column is that large."""
    vocab = 64
    columns = column_counters(vocab, torch.device("cpu"))
    for start in range(0, 2_000_000, 100_000):
        keys = torch.arange(start, start + 100_000, dtype=torch.int32)
        noise = gumbel_noise(keys, columns)  # [K, 64]
        hits = (noise[:, 16:] > 14.1).nonzero()
        if hits.numel():
            row, column = hits[0, 0].item(), hits[0, 1].item() + 16  # in a later 16-lane chunk than token 0
            break
    else:
        pytest.fail("no key with noise > 14.1 at a column >= 16")
    key = keys[row:row + 1]
    g = noise[row]
    logits = torch.full((1, vocab), -INF)
    logits[0, 0] = 0.0
    logits[0, column] = (g[0] - g[column] + 0.5).item()  # ~14 below token 0, yet its score is 0.5 higher
    assert torch_draw(logits, key).item() == column
    assert module.gumbel_argmax_rows(logits, key, columns).item() == column


def assert_top_p_as_the_full_sort(remove: torch.Tensor, logits: torch.Tensor, p: torch.Tensor) -> None:
    """remove [S, V] equals the full sort's mask but for tokens whose cumulative mass is within
    float32 rounding of 1 - p (the softmax's sum runs in another order)."""
    if logits.shape[0] == 0:
        return
    expected = processors._top_p_removed_by_full_sort(logits, p[:, None])
    for row, token in (remove != expected).nonzero().tolist():
        descending, order = logits[row].sort(descending=True, stable=True)  # the full sort's order
        ascending, order = descending.flip(-1), order.flip(-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)[(order == token).nonzero()[0, 0]]
        assert abs(cumulative.item() - (1 - p[row].item())) < 1e-5, (row, token)


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 2, 17, 5000, 49152])
def test_top_p_rows_settle_as_the_full_sort(vocab):
    gen = torch.Generator().manual_seed(vocab)
    scales = torch.tensor([[0.3], [1.0], [3.0], [8.0], [20.0], [2.0]])
    logits = torch.randn(6, vocab, generator=gen) * scales
    logits[5] = (logits[5] * 2).round() / 2  # exact ties
    settled_rows = 0
    for p_value in (0.05, 0.5, 0.9, 0.95, 0.999):
        p = torch.full((6,), p_value, dtype=torch.float64)
        remove, settled = module.top_p_rows(logits, p)
        assert_top_p_as_the_full_sort(remove[settled], logits[settled], p[settled])
        settled_rows += int(settled.sum())
    if vocab >= 5000:  # (a band may hold at most V / 8 tokens: tiny vocabularies go to the full sort)
        assert settled_rows >= 20  # most rows settle: the kernel is not just handing rows back


@needs_kernel
def test_top_p_rows_hands_back_rows_it_cannot_settle():
    logits = torch.randn(7, 4000, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, 5] = INF
    logits[2, 9] = NAN
    logits[3] = -INF
    logits[4] = 0.0  # all equal: the band is the whole row
    p = torch.full((7,), 0.9, dtype=torch.float64)
    p[5] = 0.99999999  # settled or not, as the float64 sums fall
    remove, settled = module.top_p_rows(logits, p)
    assert settled[[0, 1, 2, 3, 4, 6]].tolist() == [True, False, False, False, False, True]
    # Through top_p_removed, those rows take the full sort: the same mask as without the kernel.
    with_kernel = processors.top_p_removed(logits, p[:, None], kernel=module.top_p_rows)
    assert torch.equal(with_kernel[1:5], processors._top_p_removed_by_full_sort(logits[1:5], p[1:5, None]))
    assert_top_p_as_the_full_sort(with_kernel, logits, p)


@needs_kernel
def test_top_p_rows_refuses_what_it_was_not_built_for():
    p = torch.full((2,), 0.9, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="p must be"):
        module.top_p_rows(torch.randn(2, 8), p.float())
    with pytest.raises(RuntimeError, match="p must be"):
        module.top_p_rows(torch.randn(3, 8), p)
    with pytest.raises(RuntimeError, match="float32"):
        module.top_p_rows(torch.randn(2, 8).bfloat16(), p)
