"""The paged forward against transformers: ragged prefill + decode batches, prefix-cache hits,
preemption and forked samples must all give the logprobs of one plain full forward.

The tiny random-weight Llama is loaded into transformers' LlamaForCausalLM with the very
same weights, so every token the engine emits is checked against an independent forward.
"""

from __future__ import annotations

import json

import pytest
import torch

from model_worker.engine import LLMEngine
from model_worker.kv_cache import PagedKVCache, kv_bytes_per_token, num_kv_blocks
from model_worker.model_runner import ModelRunner, dummy_weights
from model_worker.models.llama import LlamaShape
from model_worker.sequence import FinishReason, SamplingParams

CPU = torch.device("cpu")
TOL = 2e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_model_dir)
    model = LlamaForCausalLM(config).eval()
    shape = LlamaShape.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    missing, unexpected = model.load_state_dict(dummy_weights(shape), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model.tie_weights()
    return model


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)  # [len, V]


def run_engine(engine: LLMEngine, adds: list[tuple], after_steps: dict[int, list[tuple]] | None = None):
    """adds: (request_id, prompt, kwargs); after_steps: more adds before step k. Returns the
    outputs per (request_id, index)."""
    outputs: dict[tuple[int, int], list] = {}
    for rid, prompt, kwargs in adds:
        engine.add_request(rid, prompt, **kwargs)
    step = 0
    while engine.has_work() or (after_steps and step in after_steps):
        for rid, prompt, kwargs in (after_steps or {}).pop(step, []):
            engine.add_request(rid, prompt, **kwargs)
        for out in engine.step():
            outputs.setdefault((out.seq_id, out.index), []).append(out)
        step += 1
    return outputs


def check_against_hf(hf_model, prompt: list[int], outs: list, greedy: bool) -> None:
    tokens = prompt + [o.token_id for o in outs]
    ref = hf_logprobs(hf_model, tokens[:-1])
    for j, out in enumerate(outs):
        row = ref[len(prompt) - 1 + j]
        assert abs(out.logprob - float(row[out.token_id])) < TOL, (j, out.logprob, float(row[out.token_id]))
        if greedy:
            assert float(row.max()) - float(row[out.token_id]) < TOL


def kw(max_tokens: int, **sampling) -> dict:
    return dict(sampling=SamplingParams(logprobs=True, **sampling), max_tokens=max_tokens, stop_token_ids=[],
                ignore_eos=True)


def test_ragged_batches_prefix_hits_preemption_and_forks_match_transformers(tiny_model_dir, hf_model):
    # 96 tokens of cache (24 blocks of 4) for up to 6 running sequences forces preemption;
    # a 7-token step budget forces chunked prefill next to running decodes.
    runner = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=6, max_model_len=64,
                         block_size=4, kv_cache_tokens=96)
    engine = LLMEngine(runner, [], max_num_seqs=6, max_num_batched_tokens=7, max_waiting_requests=100)
    shared = list(range(300, 313))  # 13 tokens: 3 full blocks to share
    prompts = {
        0: shared + [5, 6],
        1: list(range(40, 63)),
        2: [7, 8],
        3: shared + [9],  # added later: hits the cached prefix of request 0
        4: [11, 12, 13, 14, 15],  # n=3 sampled: forks share its prompt, copy its partial block
    }
    adds = [(0, prompts[0], kw(12)), (1, prompts[1], kw(10)), (2, prompts[2], kw(14)),
            (4, prompts[4], {**kw(9, temperature=1.0), "n": 3})]
    outputs = run_engine(engine, adds, after_steps={6: [(3, prompts[3], kw(8))]})
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hit_tokens >= 12
    assert outputs[(3, 0)][-1].num_cached_prompt_tokens == 12
    assert {k for k in outputs if k[0] == 4} == {(4, 0), (4, 1), (4, 2)}
    # The samples diverge, so each wrote its own tokens after the shared prompt blocks.
    assert len({tuple(o.token_id for o in outputs[(4, i)]) for i in range(3)}) == 3
    for (rid, _), outs in outputs.items():
        assert outs[-1].finish_reason == FinishReason.LENGTH
        check_against_hf(hf_model, prompts[rid], outs, greedy=rid != 4)
    assert engine.block_manager.num_used_blocks == 0


def test_best_of_returns_the_n_highest_cumulative_logprobs(tiny_model_dir, hf_model):
    runner = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=8, max_model_len=64,
                         block_size=4, kv_cache_tokens=512)
    engine = LLMEngine(runner, [], max_num_seqs=8, max_num_batched_tokens=64, max_waiting_requests=100)
    prompt = [21, 22, 23, 24, 25, 26]
    sampling = SamplingParams(temperature=1.5, seed=3)
    engine.add_request(0, prompt, sampling, 6, [], True, n=2, best_of=5)
    group = engine.groups[0]
    outputs: list = []
    streamed_before_end = 0
    while engine.has_work():
        step_outs = engine.step()
        if not step_outs:
            continue
        if not step_outs[-1].request_finished:
            streamed_before_end += len(step_outs)
        outputs += step_outs
    assert streamed_before_end == 0  # best_of > n: nothing until every sample ends
    assert {o.index for o in outputs} == {0, 1}
    assert outputs[-1].request_finished and sum(o.request_finished for o in outputs) == 1
    # The two returned are the best two of five, best first, by the raw logprobs of their tokens.
    totals = []
    for index in (0, 1):
        outs = [o for o in outputs if o.index == index]
        assert len(outs) == 6 and all(o.logprob is None for o in outs)  # not asked for: not sent
        tokens = prompt + [o.token_id for o in outs]
        ref = hf_logprobs(hf_model, tokens[:-1])
        totals.append(sum(float(ref[len(prompt) - 1 + j, t]) for j, t in enumerate(tokens[len(prompt):])))
    ranked = sorted(group.cumulative_logprobs, reverse=True)
    assert totals[0] == pytest.approx(ranked[0], abs=1e-3) and totals[1] == pytest.approx(ranked[1], abs=1e-3)
    assert len(set(group.cumulative_logprobs)) > 1  # the samples really differ
    assert engine.block_manager.num_used_blocks == 0


def test_kv_cache_bytes_follow_the_model_arithmetic_and_blocks_return_after_finish_and_abort(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=8, max_model_len=64,
                         block_size=8, kv_cache_tokens=256)
    kv, s = runner.kv_cache, runner.shape
    per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * 4
    assert kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, torch.float32) == per_token
    assert kv.num_blocks == 32 and kv.num_bytes == kv.num_blocks * kv.block_size * per_token
    assert kv.key.shape == (s.num_layers, 32, 8, s.num_kv_heads, s.head_dim)
    engine = LLMEngine(runner, [], max_num_seqs=8, max_num_batched_tokens=32, max_waiting_requests=1000)
    bm = engine.block_manager
    for round_ in range(5):
        for i in range(12):
            rid = round_ * 100 + i
            engine.add_request(rid, [1 + i, 2, 3, 4 + round_] * (i % 4 + 1), SamplingParams(), 5 + i, [], True,
                               n=1 + i % 3)
        for _ in range(4):
            engine.step()
        assert bm.num_used_blocks > 0
        for i in range(0, 12, 3):
            engine.abort_request(round_ * 100 + i)
        while engine.has_work():
            engine.step()
        assert bm.num_used_blocks == 0 and not engine.groups and not engine._group_of
        assert all(b.ref_count == 0 for b in bm.blocks)


def test_kv_cache_sizing():
    per_token, bs = 1000, 16
    assert num_kv_blocks(per_token, bs, 4, 256, CPU, kv_cache_tokens=1024) == 64
    assert num_kv_blocks(per_token, bs, 4, 256, CPU, kv_cache_memory_bytes=512_000) == 32
    # Capped at max_num_seqs full contexts.
    assert num_kv_blocks(per_token, bs, 2, 256, CPU, kv_cache_tokens=10_000) == 32
    with pytest.raises(ValueError, match="fewer than one"):
        num_kv_blocks(per_token, bs, 4, 256, CPU, kv_cache_tokens=100)
    # Tokens enough, blocks too large: the message named the tokens, which were not the cause.
    with pytest.raises(ValueError, match="hold 0 blocks of --block-size 100000"):
        num_kv_blocks(per_token, 100_000, 4, 256, CPU, kv_cache_tokens=50_000)
    cache = PagedKVCache(2, 3, 4, 1, 2, torch.float32, CPU)
    cache.key[:, 0] = 1.0
    cache.copy_blocks(torch.tensor([0]), torch.tensor([2]))
    assert bool((cache.key[:, 2] == 1.0).all()) and bool((cache.key[:, 1] == 0.0).all())
