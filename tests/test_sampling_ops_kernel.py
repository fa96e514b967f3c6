"""The sampler's compiled greedy pick (model_worker/kernels/sampling_ops.cpp) against torch.argmax.

Skipped where it cannot be used: a CPU without AVX-512 or no C++ compiler; the sampler then runs
torch.argmax, which the rest of the suite covers. Where both are there, a kernel that fails to
build fails these tests instead of skipping them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from model_worker import kernels
from model_worker.sampling.sampler import Sampler

CAN_BUILD = "avx512f" in kernels.cpu_flags() and shutil.which(os.environ.get("CXX", "c++")) is not None
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


def test_the_sampler_falls_back_to_torch():
    sampler = Sampler(8, torch.device("cpu"))
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, NAN, 0.0, 0.0, 0.0]])
    assert sampler._argmax(logits).tolist() == [4]
