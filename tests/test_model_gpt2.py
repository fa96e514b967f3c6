"""Native GPT-2: a tiny random GPT2LMHeadModel saved as safetensors runs through the ragged
forward (chunked prefill next to batched decodes) with transformers' logits and greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from model_worker.model_runner import ModelRunner, dummy_weights
from model_worker.models.gpt2 import GPT2Model, GPT2Shape
from tests.tiny_hf_models import (
    PROMPTS,
    assert_greedy_matches_transformers,
    assert_prompt_logprobs_match_transformers,
    engine_greedy,
    save_tiny_model,
)

CPU = torch.device("cpu")


def tiny_gpt2(tmp_path, tiny_model_dir, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=49152, n_positions=256, n_embd=64, n_layer=3, n_head=4,
                        bos_token_id=1, eos_token_id=2, **overrides)
    model = GPT2LMHeadModel(config).eval()
    # Larger than the 0.02 init, so the layers matter to the logits and bugs show.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, save_tiny_model(model, tmp_path, tiny_model_dir)


@pytest.mark.parametrize("overrides", [{}, {"scale_attn_by_inverse_layer_idx": True, "activation_function": "gelu"}])
def test_ragged_steps_match_transformers(tmp_path, tiny_model_dir, overrides):
    model, model_dir = tiny_gpt2(tmp_path, tiny_model_dir, **overrides)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=128)
    assert isinstance(runner.model, GPT2Model)
    assert_greedy_matches_transformers(runner, model)


def test_prompt_logprobs_match_transformers(tmp_path, tiny_model_dir):
    model, model_dir = tiny_gpt2(tmp_path, tiny_model_dir)
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=128)
    assert_prompt_logprobs_match_transformers(runner, model)


def test_dummy_weights_load_and_run(tmp_path, tiny_model_dir):
    _, model_dir = tiny_gpt2(tmp_path, tiny_model_dir)
    shape = GPT2Shape.from_config(json.loads((model_dir / "config.json").read_text()))
    assert set(dummy_weights(shape)) >= {"transformer.wte.weight", "transformer.h.2.attn.c_attn.weight"}
    runner = ModelRunner(model_dir, "dummy", CPU, torch.float32, max_num_seqs=4, max_model_len=64)
    outputs = engine_greedy(runner, PROMPTS[1:3], max_tokens=3, step_budget=16)
    assert all(len(outs) == 3 for outs in outputs.values())


@pytest.mark.parametrize(("change", "message"), [
    ({"add_cross_attention": True}, "cross-attention"),
    ({"activation_function": "quick_gelu_x"}, "activation_function"),
])
def test_unsupported_configs_are_refused(change, message):
    config = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 4,
              **change}
    with pytest.raises(ValueError, match=message):
        GPT2Shape.from_config(config)


def test_context_beyond_learned_positions_is_refused(tmp_path, tiny_model_dir):
    _, model_dir = tiny_gpt2(tmp_path, tiny_model_dir)
    with pytest.raises(ValueError, match="n_positions"):
        ModelRunner(model_dir, "dummy", CPU, torch.float32, max_num_seqs=4, max_model_len=512)
