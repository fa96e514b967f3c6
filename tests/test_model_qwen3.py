"""Qwen3 runs natively (llama.py with per-head q/k RMSNorm): a tiny random Qwen3ForCausalLM saved
as safetensors gives transformers' logits and greedy tokens through ragged engine steps."""

from __future__ import annotations

import pytest
import torch

from model_worker.model_runner import ModelRunner
from model_worker.models.llama import LlamaModel, LlamaShape
from tests.tiny_hf_models import (
    PROMPTS,
    assert_greedy_matches_transformers,
    engine_greedy,
    save_tiny_model,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_model_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():  # beyond the small init (and norms off 1), so every weight moves the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, save_tiny_model(model, tmp_path_factory.mktemp("qwen3"), tiny_model_dir)


def test_ragged_steps_match_transformers(qwen3):
    model, model_dir = qwen3
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=128)
    assert isinstance(runner.model, LlamaModel) and runner.shape.qk_norm
    assert_greedy_matches_transformers(runner, model)


def test_dummy_weights_run(qwen3):
    _, model_dir = qwen3
    runner = ModelRunner(model_dir, "dummy", CPU, torch.float32, max_num_seqs=4, max_model_len=64)
    outputs = engine_greedy(runner, PROMPTS[1:3], max_tokens=3, step_budget=16)
    assert all(len(outs) == 3 for outs in outputs.values())


@pytest.mark.parametrize("max_window_layers", [0, 1, 28])
def test_sliding_window_layers_as_transformers_derives_them(max_window_layers):
    """use_sliding_window windows the layers transformers' Qwen3Config marks sliding_attention
    (from max_window_layers on); the window itself is run in test_model_llama_variants.py."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, use_sliding_window=True, sliding_window=32,
                         max_window_layers=max_window_layers).to_dict()
    expected = tuple(t == "sliding_attention" for t in config["layer_types"])
    for saved in (config, {k: v for k, v in config.items() if k != "layer_types"}):  # older configs lack it
        shape = LlamaShape.from_config({**saved, "architectures": ["Qwen3ForCausalLM"]})
        assert (shape.sliding_window, shape.sliding_layers) == ((32, expected) if any(expected) else (0, ()))
