"""The compiled bf16 RMSNorm and residual-add + RMSNorm (model_worker/kernels/rms_norm.cpp)
against llama.py's torch ops.

Skipped where it cannot be used: a CPU without AVX512-BF16 or no C++ compiler; the model then
runs the torch ops, which the rest of the suite covers. Where both are there, a kernel that fails
to build fails these tests instead of skipping them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from model_worker import kernels
from model_worker.model_runner import ModelRunner
from model_worker.models import llama
from tests.tiny_hf_models import PROMPTS, engine_greedy

CAN_BUILD = ({"avx512f", "avx512_bf16"} <= kernels.cpu_flags()
             and shutil.which(os.environ.get("CXX", "c++")) is not None)
module = kernels.rms_norm_module()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no AVX512-BF16 CPU or no C++ compiler here")
EPS = 1e-5


def test_the_kernel_builds_where_it_can():
    assert (module is not None) == CAN_BUILD


def _rows(num_rows: int, hidden: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The only difference allowed: the float32 sum of squares taken in another order, which may
    move an element across one bf16 rounding boundary."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - expected.float()).abs() <= ulp).all()
    assert (got != expected).sum().item() <= 0.01 * got.numel()


@needs_kernel
@pytest.mark.parametrize("hidden", [576, 64, 100, 4096], ids=["smollm2", "one-vector-multiple", "masked-tail", "8b"])
@pytest.mark.parametrize("num_rows", [0, 1, 3, 70], ids=["empty", "decode", "few", "parallel-rows"])
def test_matches_the_torch_ops(hidden, num_rows):
    x, delta = _rows(num_rows, hidden, 1, 4.0), _rows(num_rows, hidden, 2)
    weight = _rows(1, hidden, 3)[0]
    _assert_within_one_rounding(module.rms_norm(x, weight, EPS), llama.rms_norm(x, weight, EPS))
    x_sum, h = module.add_rms_norm(x, delta, weight, EPS)
    expected_sum, expected_h = llama.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(x_sum, expected_sum)  # the same single bf16 rounding of the add
    _assert_within_one_rounding(h, expected_h)
    assert torch.equal(x, _rows(num_rows, hidden, 1, 4.0))  # inputs left as they were


@needs_kernel
def test_a_non_finite_row_only_spoils_itself():
    x = _rows(3, 576, 4)
    x[1, 9] = float("nan")
    x[2, 3] = float("inf")
    weight = _rows(1, 576, 5)[0]
    h = module.rms_norm(x, weight, EPS)
    assert h[1].isnan().all() and not h[0].isnan().any()
    expected = llama.rms_norm(x, weight, EPS)
    assert torch.equal(h[2].isnan(), expected[2].isnan())
    _assert_within_one_rounding(h[:1], expected[:1])


@needs_kernel
def test_refuses_what_it_was_not_built_for():
    x, weight = _rows(2, 64, 6), _rows(1, 64, 7)[0]
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.rms_norm(x.float(), weight, EPS)
    with pytest.raises(RuntimeError, match="contiguous"):
        module.rms_norm(_rows(64, 2, 8).t(), weight, EPS)
    with pytest.raises(RuntimeError, match="weight"):
        module.rms_norm(x, weight[:32], EPS)
    with pytest.raises(RuntimeError, match="delta"):
        module.add_rms_norm(x, x[:1], weight, EPS)


@needs_kernel
def test_the_llama_forward_uses_it_on_bf16_and_scores_prompts_like_the_torch_ops(tiny_model_dir):
    def runner(cpu_decode_kernel: bool, dtype: torch.dtype = torch.bfloat16) -> ModelRunner:
        return ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), dtype, 8, 64, kv_cache_tokens=512,
                           cpu_decode_kernel=cpu_decode_kernel)

    with_kernel, torch_ops = runner(True), runner(False)
    assert with_kernel.model.add_rms_norm is module.add_rms_norm
    assert torch_ops.model.add_rms_norm is llama.add_rms_norm
    assert runner(True, torch.float32).model.add_rms_norm is llama.add_rms_norm
    # Teacher-forced prompt logprobs over every layer's norms (a prefill in 10-token chunks, so
    # several rows a call), and the decode rows after them: no greedy split can hide a bad norm.
    prompt = PROMPTS[0]
    got, expected = (engine_greedy(r, [prompt], max_tokens=3, step_budget=10, prompt_logprobs=0)[0]
                     for r in (with_kernel, torch_ops))
    got_prompt, expected_prompt = got[0].prompt_logprobs.logprobs[1:], expected[0].prompt_logprobs.logprobs[1:]
    assert len(got_prompt) == len(expected_prompt) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(got_prompt, expected_prompt, strict=True)) < 0.05
    assert got[0].token_id == expected[0].token_id
