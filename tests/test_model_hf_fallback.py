"""The transformers fallback: an architecture with no native model (tiny random GPT-NeoX and OPT,
saved as safetensors) runs through the engine with transformers' greedy tokens, including
chunked prefill, n > 1 forks and preemption under a small KV budget."""

from __future__ import annotations

import json

import pytest
import torch

from model_worker.engine import LLMEngine
from model_worker.model_runner import ModelRunner
from model_worker.models.hf_fallback import HFCausalLM
from model_worker.sequence import SamplingParams, Sequence
from tests.tiny_hf_models import (
    PROMPTS,
    assert_greedy_matches_transformers,
    assert_prompt_logprobs_match_transformers,
    hf_greedy,
    save_tiny_model,
)

CPU = torch.device("cpu")


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=256, rotary_pct=0.5, bos_token_id=1, eos_token_id=2))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(
        vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
        word_embed_proj_dim=64, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _mamba():
    # A state-space model: its cache is a state, not KV, passed under transformers 5's `cache`
    # (given as past_key_values it was ignored, and every step restarted from an empty state).
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(
        vocab_size=49152, hidden_size=64, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


BUILDERS = {"GPTNeoXForCausalLM": _gpt_neox, "OPTForCausalLM": _opt, "MambaForCausalLM": _mamba}


def tiny_model(tmp_path, tiny_model_dir, architecture: str):
    torch.manual_seed(0)
    model = BUILDERS[architecture]().eval()
    with torch.no_grad():  # beyond the small init, so every layer moves the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, save_tiny_model(model, tmp_path, tiny_model_dir)


@pytest.fixture(scope="module")
def neox(tmp_path_factory, tiny_model_dir):
    return tiny_model(tmp_path_factory.mktemp("neox"), tiny_model_dir, "GPTNeoXForCausalLM")


@pytest.mark.parametrize("architecture", list(BUILDERS))
def test_ragged_steps_match_transformers(tmp_path, tiny_model_dir, architecture):
    model, model_dir = tiny_model(tmp_path, tiny_model_dir, architecture)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [architecture]
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=128)
    assert isinstance(runner.model, HFCausalLM)
    assert not runner.supports_prefix_caching
    # Mamba takes its cache one token at a time: its later prefill chunks are computed from token 0.
    assert runner.model.continues_chunks == (architecture != "MambaForCausalLM")
    # A 7-token budget pushes the 37-token prompt through 6 chunks beside the others' decodes.
    assert_greedy_matches_transformers(runner, model)


def test_forks_and_preemption_give_transformers_tokens(neox):
    model, model_dir = neox
    # Room for 64 tokens in all: two sequences of 40 and 45 tokens preempt each other, and the
    # forked samples wait for blocks of their own.
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=64,
                         kv_cache_tokens=64)
    engine = LLMEngine(runner, [], max_num_seqs=8, max_num_batched_tokens=16, max_waiting_requests=16)
    assert not engine.block_manager.enable_prefix_caching
    prompts = {0: PROMPTS[0], 1: PROMPTS[2], 2: PROMPTS[0][5:]}
    engine.add_request(0, prompts[0], SamplingParams(), 8, [], True)
    engine.add_request(1, prompts[1], SamplingParams(), 8, [], True, n=3)
    engine.add_request(2, prompts[2], SamplingParams(), 8, [], True)
    tokens: dict[tuple[int, int], list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            if out.token_id is not None:
                tokens.setdefault((out.seq_id, out.index), []).append(out.token_id)
    assert engine.scheduler.num_preemptions > 0
    assert sorted(tokens) == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0)]
    expected = {rid: hf_greedy(model, prompt, 8) for rid, prompt in prompts.items()}
    for (rid, _), got in tokens.items():
        assert got == expected[rid]
    # Caches of finished sequences go at the next step's start (here: by hand), none stay.
    runner.model.drop_freed_caches()
    assert runner.model.num_cached_sequences == 0


def test_the_kv_budget_bounds_the_copies_forked_samples_hold(neox):
    """Each sample's cache is its own copy here, so each takes blocks of its own (review finding:
    8 samples of a 48-token prompt held 408 tokens in caches against a 192-token budget while the
    block manager counted the shared blocks once). Samples without room wait and recompute."""
    model, model_dir = neox
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=64,
                         kv_cache_tokens=192)
    engine = LLMEngine(runner, [], max_num_seqs=8, max_num_batched_tokens=64, max_waiting_requests=16)
    budget = engine.block_manager.num_blocks * engine.block_manager.block_size
    prompt = list(range(100, 148))
    engine.add_request(0, prompt, SamplingParams(), 4, [], True, n=8)
    tokens: dict[int, list[int]] = {}
    most_held = 0
    while engine.has_work():
        for out in engine.step():
            if out.token_id is not None:
                tokens.setdefault(out.index, []).append(out.token_id)
        most_held = max(most_held, sum(c.num_tokens for c in runner.model._caches.values()))
    assert 48 * 2 < most_held <= budget  # some samples ran side by side, within the budget
    expected = hf_greedy(model, prompt, 4)
    assert tokens == {index: expected for index in range(8)}  # greedy: every sample the same tokens
    assert engine.block_manager.num_used_blocks == 0


def test_fork_copies_the_parent_cache_instead_of_recomputing(neox):
    _, model_dir = neox
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=4, max_model_len=64)
    hf = runner.model
    prompt = PROMPTS[3]
    parent = Sequence(0, list(prompt), SamplingParams(), 4, frozenset(), block_table=[0])
    hf.begin_step([(parent, 0)])
    first = int(hf.forward_chunk(parent, 0, len(prompt), keep=1)[0].argmax())
    parent.output_token_ids.append(first)
    child = Sequence(1, list(prompt), SamplingParams(), 4, frozenset(), output_token_ids=[first], block_table=[0])
    hf.begin_step([(parent, len(prompt)), (child, len(prompt))])
    assert hf.num_cached_sequences == 2  # the child got a copy before either decoded
    parent_logits = hf.forward_chunk(parent, len(prompt), 1, keep=1)
    child_logits = hf.forward_chunk(child, len(prompt), 1, keep=1)
    assert torch.equal(parent_logits, child_logits)
    parent.block_table = []  # freed, as the block manager does on finish
    hf.begin_step([])
    assert hf.num_cached_sequences == 1


def test_prompt_logprobs_match_transformers(neox):
    model, model_dir = neox
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=128)
    assert_prompt_logprobs_match_transformers(runner, model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_start_up_check_tells_models_that_take_a_cache_one_token_at_a_time(tmp_path, tiny_model_dir, dtype):
    # In bfloat16 a tolerance of 3% of the logits' scale passed Mamba (0.10 off against 0.14).
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    torch.manual_seed(0)
    falcon_mamba = FalconMambaForCausalLM(FalconMambaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                                                            state_size=8, expand=2, conv_kernel=4)).eval()
    builders = {"mamba": _mamba, "falcon_mamba": lambda: falcon_mamba, "neox": _gpt_neox, "opt": _opt}
    for name, build in builders.items():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model_dir = save_tiny_model(model, tmp_path / name, tiny_model_dir)
        runner = ModelRunner(model_dir, "auto", CPU, dtype, max_num_seqs=2, max_model_len=64)
        assert runner.model.continues_chunks == (name in ("neox", "opt")), (name, dtype)


def test_an_ended_sequence_drops_its_cache_at_once(neox):
    # Not at the next request's step: an idle worker held the caches of everything that had run.
    _, model_dir = neox
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=4, max_model_len=64)
    engine = LLMEngine(runner, [], max_num_seqs=4, max_num_batched_tokens=64, max_waiting_requests=4)
    engine.add_request(0, PROMPTS[2], SamplingParams(), 3, [], True)
    engine.add_request(1, PROMPTS[3], SamplingParams(), 50, [], True)
    engine.step()
    assert runner.model.num_cached_sequences == 2
    engine.abort_request(1)
    while engine.has_work():
        engine.step()
    assert runner.model.num_cached_sequences == 0 and engine.block_manager.num_used_blocks == 0


def test_a_model_whose_forward_takes_no_cache_is_refused(tmp_path, tiny_model_dir):
    # RWKV's forward takes its recurrent state as `state`: every step failed on the missing field.
    from transformers import RwkvConfig, RwkvForCausalLM

    model = RwkvForCausalLM(RwkvConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=2,
                                       attention_hidden_size=32, intermediate_size=64, context_length=64))
    model_dir = save_tiny_model(model, tmp_path, tiny_model_dir)
    with pytest.raises(ValueError, match="takes no cache argument"):
        ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=2, max_model_len=64)


def test_architecture_transformers_cannot_build_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["NoSuchForCausalLM"], "model_type": "no_such_model", "vocab_size": 100,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        ModelRunner(tmp_path, "dummy", CPU, torch.float32, max_num_seqs=2, max_model_len=64)


@pytest.mark.parametrize(("config", "num_kv_heads"), [
    ({"num_attention_heads": 8, "num_key_value_heads": 2}, 2),
    ({"n_head": 71, "multi_query": True}, 1),  # falcon-7b: one KV head
    ({"num_attention_heads": 128, "num_kv_heads": 8, "multi_query": True}, 8),  # falcon-40b's new decoder
    ({"n_head": 16, "n_head_kv": 4}, 4),
    ({"n_head": 12, "multi_query": True}, 1),  # GPTBigCode
    ({"num_attention_heads": 12}, 12),
])
def test_the_kv_budget_counts_the_kv_heads_each_family_spells(config, num_kv_heads):
    from model_worker.models.hf_fallback import HFShape

    shape = HFShape.from_config({"architectures": ["X"], "vocab_size": 10, "hidden_size": 1536, "num_hidden_layers": 2,
                                 **config})
    assert shape.num_kv_heads == num_kv_heads
