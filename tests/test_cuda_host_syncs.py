"""On CUDA a decode step waits for the device once, in the sampler's host copy
(SamplerOutput.to_host): inputs go up through pinned memory (model_worker/device_transfer.py), and
the sampler takes no data-dependent shortcut there (processors: the candidate count, the top
logprobs' tie spill). DRY, mirostat and prompt logprobs still read values back and are left out.
Skips without CUDA; on the CPU the same code runs the same values (the rest of the suite)."""

from __future__ import annotations

import warnings

import pytest
import torch

from model_worker.device_transfer import moved_to, tensor_on
from model_worker.engine import LLMEngine
from model_worker.model_runner import ModelRunner
from model_worker.sequence import LogprobsMode, SamplingParams

SAMPLINGS = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1),
    SamplingParams(logprobs=True, top_logprobs=5, logprobs_mode=LogprobsMode.PROCESSED, temperature=0.9, seed=2),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                   repeat_penalty=1.2, penalty_last_n=16, seed=3),
    SamplingParams(temperature=0.7, min_p=0.05, typical_p=0.9, top_n_sigma=2.0, logit_bias=((5, 2.0),),
                   bad_words=((7,), (11, 12)), min_tokens=4, xtc_probability=0.5, seed=4),
]


def test_transfers_give_the_same_tensors_on_the_cpu():
    cpu = torch.device("cpu")
    assert torch.equal(tensor_on(cpu, [1, 2, 3], torch.long), torch.tensor([1, 2, 3]))
    assert tensor_on(cpu, [0.5], torch.float32).dtype == torch.float32
    host = torch.arange(6).view(2, 3)
    assert moved_to(cpu, host) is host


@pytest.mark.gpu
@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_decode_steps_wait_for_the_device_once(tiny_model_dir, decode_graphs):
    cuda = torch.device("cuda")
    runner = ModelRunner(tiny_model_dir, "dummy", cuda, torch.bfloat16, max_num_seqs=8, max_model_len=256,
                         decode_graphs=decode_graphs)
    engine = LLMEngine(runner, [], max_num_seqs=8, max_num_batched_tokens=256, max_waiting_requests=16)
    for i, sampling in enumerate(SAMPLINGS):
        engine.add_request(i, [100 + i, 200, 300, 400 + i], sampling, max_tokens=40, stop_token_ids=[2],
                           ignore_eos=True)
    for _ in range(3):  # prefill, then warm-up decodes (allocator, kernel selection)
        engine.step()
    syncs_per_step = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(10):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outputs = engine.step()
            assert len(outputs) == len(SAMPLINGS)
            syncs_per_step.append([str(w.message) for w in caught if "synchroniz" in str(w.message)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Exactly one: SamplerOutput.to_host's stream sync (seen, so the warnings are being caught).
    assert all(len(s) == 1 for s in syncs_per_step), syncs_per_step
