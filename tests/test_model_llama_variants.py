"""Llama-family checkpoint variants run natively and match transformers: scaled RoPE (llama3,
linear, dynamic, yarn) and sliding-window attention (Mistral on every layer, Qwen2 per layer),
each a tiny random model through ragged engine steps, plus the refusals of what is not done.

Every variant also runs once with the variant switched off in config.json (same weights), to
show the chosen lengths make it matter: a test that would pass without the feature proves
nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model_worker.attention_metadata import AttentionMetadata
from model_worker.model_runner import ModelRunner
from model_worker.models.llama import LlamaModel, LlamaShape
from model_worker.models.rope import RopeScaling, inv_freq_and_attention_factor
from tests.tiny_hf_models import (
    assert_greedy_matches_transformers,
    assert_prompt_logprobs_match_transformers,
    max_logprob_error,
    perturb_weights,
    save_tiny_model,
)

CPU = torch.device("cpu")
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
# Wavelengths of head_dim 16 at theta 1e4 run 6.3 .. 2e4 tokens: with an original length of 64
# (low/high frequency wavelengths 64 and 16) llama3 keeps one band, blends two and divides five.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
WINDOW = 8  # PROMPTS' 37-token prompt and every 8-token generation run past it


def tiny(config_class, model_class, tmp: Path, tokenizer_dir: Path, **config):
    torch.manual_seed(0)
    model = model_class(config_class(**{**SMALL, **config})).eval()
    perturb_weights(model)
    return model, save_tiny_model(model, tmp, tokenizer_dir)


def with_config(model_dir: Path, out: Path, **changes) -> Path:
    """A copy of model_dir (same weights) with config.json keys replaced."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def runner_for(model_dir: Path, max_model_len: int = 128, batch_invariant: bool = False) -> ModelRunner:
    return ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=max_model_len,
                       batch_invariant=batch_invariant)


@pytest.fixture(scope="module")
def llama_factory(tmp_path_factory, tiny_model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(rope: dict):
        return tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp(rope["rope_type"]), tiny_model_dir,
                    rope_parameters=dict(rope))
    return make


@pytest.mark.parametrize("rope", [LLAMA3, LINEAR, YARN], ids=lambda r: r["rope_type"])
def test_scaled_rope_matches_transformers(llama_factory, tmp_path, rope):
    model, model_dir = llama_factory(rope)
    runner = runner_for(model_dir)
    assert isinstance(runner.model, LlamaModel) and runner.shape.rope.rope_type == rope["rope_type"]
    assert_greedy_matches_transformers(runner, model)
    # The same weights with plain RoPE give other logprobs: the scaling is what matched.
    plain = with_config(model_dir, tmp_path / "plain", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert max_logprob_error(runner_for(plain), model) > 1e-2


@pytest.mark.parametrize("rope", [
    LLAMA3, LINEAR, YARN, {"rope_type": "dynamic", "factor": 1.7, "rope_theta": 10000.0},
    {**YARN, "mscale": 0.7, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False},
    {**YARN, "attention_factor": 1.3},
], ids=["llama3", "linear", "yarn", "dynamic", "yarn-mscale", "yarn-attention-factor"])
def test_inv_freq_is_transformers_own(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**{**SMALL, "rope_parameters": dict(rope)})
    expected, expected_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    inv_freq, factor = inv_freq_and_attention_factor(RopeScaling.from_config(config.to_dict()), 16, 256)
    assert torch.equal(inv_freq, expected) and factor == expected_factor


def test_yarn_scales_cos_and_sin(llama_factory):
    _, model_dir = llama_factory(YARN)
    model = runner_for(model_dir).model
    # attention_factor 0.1 ln(4) + 1 on every table entry: cos^2 + sin^2 is its square.
    norm = (model.cos ** 2 + model.sin ** 2).sqrt()  # [max_pos, D]
    assert torch.allclose(norm, torch.full_like(norm, 0.1 * torch.log(torch.tensor(4.0)).item() + 1), atol=1e-5)


def test_dynamic_rope_within_max_position_embeddings(llama_factory):
    model, model_dir = llama_factory(DYNAMIC)
    assert_greedy_matches_transformers(runner_for(model_dir, max_model_len=128), model)
    # Beyond max_position_embeddings (256) transformers' frequencies depend on earlier batches.
    with pytest.raises(ValueError, match="dynamic"):
        runner_for(model_dir, max_model_len=512)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tiny_model_dir):
    from transformers import MistralConfig, MistralForCausalLM

    return tiny(MistralConfig, MistralForCausalLM, tmp_path_factory.mktemp("mistral"), tiny_model_dir,
                sliding_window=WINDOW)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["paged", "batch_invariant"])
def test_mistral_sliding_window_matches_transformers(mistral, tmp_path, batch_invariant):
    model, model_dir = mistral
    runner = runner_for(model_dir, batch_invariant=batch_invariant)
    assert runner.shape.sliding_window == WINDOW and all(runner.shape.sliding_layers)
    assert_greedy_matches_transformers(runner, model)
    # 10-token chunks: the first, with nothing cached, is already longer than the window.
    assert_prompt_logprobs_match_transformers(runner, model)
    unwindowed = with_config(model_dir, tmp_path / "full", sliding_window=None)
    assert max_logprob_error(runner_for(unwindowed, batch_invariant=batch_invariant), model) > 1e-2


def test_qwen2_window_on_layers_from_max_window_layers(tmp_path_factory, tiny_model_dir, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Layer 0 attends fully, layer 1 within the window: per-layer masks in one step.
    model, model_dir = tiny(Qwen2Config, Qwen2ForCausalLM, tmp_path_factory.mktemp("qwen2"), tiny_model_dir,
                            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    runner = runner_for(model_dir)
    assert runner.shape.sliding_layers == (False, True)
    assert_greedy_matches_transformers(runner, model)
    assert_prompt_logprobs_match_transformers(runner, model)
    unwindowed = with_config(model_dir, tmp_path / "full", use_sliding_window=False)
    assert max_logprob_error(runner_for(unwindowed), model) > 1e-2


@pytest.mark.parametrize(("family", "config", "unread"), [
    ("Llama", {"attention_bias": True}, "o_proj.bias"),
    ("Llama", {"mlp_bias": True}, "mlp.down_proj.bias"),
    ("Qwen3", {"attention_bias": True}, "o_proj.bias"),
], ids=["llama-attention-bias", "llama-mlp-bias", "qwen3-attention-bias"])
def test_bias_variants_match_transformers(tmp_path_factory, tiny_model_dir, tmp_path, family, config, unread):
    """Each bias its transformers class builds is read: o_proj's with attention_bias (Llama,
    Qwen3), the MLP's with Llama's mlp_bias. The same checkpoint with the flag off in config.json
    leaves those tensors unread, which is refused, not run with wrong logits."""
    import transformers

    config_class, model_class = (getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM"))
    model, model_dir = tiny(config_class, model_class, tmp_path_factory.mktemp(family), tiny_model_dir, **config)
    runner = runner_for(model_dir)
    assert isinstance(runner.model, LlamaModel)
    assert_greedy_matches_transformers(runner, model)
    switched_off = with_config(model_dir, tmp_path / "off", **{key: False for key in config})
    with pytest.raises(ValueError, match=f"does not read .*{unread}"):
        runner_for(switched_off)


def test_mistral_has_no_biases_whatever_its_config_says(mistral, tmp_path):
    # transformers' Mistral builds no bias, attention_bias or not: nothing to look for.
    model, model_dir = mistral
    runner = runner_for(with_config(model_dir, tmp_path / "biased", attention_bias=True, mlp_bias=True))
    assert not (runner.shape.attention_bias or runner.shape.o_bias or runner.shape.mlp_bias)
    assert_greedy_matches_transformers(runner, model)


def test_mlp_activation_is_the_configs(tmp_path_factory, tiny_model_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, model_dir = tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("gelu"), tiny_model_dir,
                            hidden_act="gelu_pytorch_tanh")
    assert_greedy_matches_transformers(runner_for(model_dir), model)
    as_silu = with_config(model_dir, tmp_path / "silu", hidden_act="silu")
    assert max_logprob_error(runner_for(as_silu), model) > 1e-2
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' not supported"):
        runner_for(with_config(model_dir, tmp_path / "quick", hidden_act="quick_gelu"))


def test_window_masks_follow_transformers_rule():
    # One 6-token chunk after 4 cached tokens, and decodes at positions 3 (inside) and 9.
    meta = AttentionMetadata.build([(list(range(4)), 4, 6)], [([4], 3), ([5, 6, 7], 9)], 4, CPU, sliding_window=3)
    seg = meta.prefills[0]
    for j, p in enumerate(range(4, 10)):
        assert seg.window_mask[j].tolist() == [p - 3 < k <= p for k in range(10)]
    # Positions [0, 12) of each decode's padded blocks.
    assert meta.decode.window_mask[0, 0, 0].tolist() == [1 <= k <= 3 for k in range(12)]
    assert meta.decode.window_mask[1, 0, 0].tolist() == [7 <= k <= 9 for k in range(12)]
    # A window longer than everything in the step excludes nothing: no window masks at all.
    meta = AttentionMetadata.build([(list(range(4)), 4, 6)], [([4], 3)], 4, CPU, sliding_window=10)
    assert meta.prefills[0].window_mask is None and meta.decode.window_mask is None


def llama_config(**changes) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256, **changes}


def test_rope_parsing_old_and_new_spellings():
    old = RopeScaling.from_config(llama_config(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    assert (old.rope_type, old.theta, old.factor) == ("linear", 5e5, 2.0)
    # llama3 without an original length falls back to max_position_embeddings, as transformers does.
    without_original = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert RopeScaling.from_config(llama_config(rope_parameters=without_original)).original_max_position_embeddings == 256
    # Phi-3-style: the top-level key wins over the one inside the rope dict.
    top_level = llama_config(rope_parameters=LLAMA3, original_max_position_embeddings=128)
    assert RopeScaling.from_config(top_level).original_max_position_embeddings == 128


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
    ({"rope_type": "proportional"}, "proportional"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_rope_is_refused_by_name(rope, match):
    with pytest.raises(ValueError, match=match):
        LlamaShape.from_config(llama_config(rope_parameters=rope))


def test_sliding_window_parsing():
    mistral = llama_config(architectures=["MistralForCausalLM"], sliding_window=None)
    assert LlamaShape.from_config(mistral).sliding_window == 0  # later Mistrals ship null
    with pytest.raises(ValueError, match="layer_types"):
        LlamaShape.from_config({**mistral, "sliding_window": 16, "layer_types": ["full_attention"] * 2})
    qwen2 = llama_config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16)
    assert LlamaShape.from_config(qwen2).sliding_window == 0  # max_window_layers 28 >= 2 layers: no window
    shape = LlamaShape.from_config({**qwen2, "layer_types": ["sliding_attention", "full_attention"]})
    assert (shape.sliding_window, shape.sliding_layers) == (16, (True, False))
    with pytest.raises(ValueError, match="layer_types"):
        LlamaShape.from_config({**qwen2, "layer_types": ["chunked_attention", "full_attention"]})
    # A config.json without the key: transformers' config classes default it to 4096.
    from transformers import MistralConfig, Qwen2Config
    no_key = {k: v for k, v in mistral.items() if k != "sliding_window"}
    assert LlamaShape.from_config(no_key).sliding_window == MistralConfig(**no_key).sliding_window == 4096
    qwen2_no_key = {k: v for k, v in qwen2.items() if k != "sliding_window"} | {"max_window_layers": 1}
    shape = LlamaShape.from_config(qwen2_no_key)
    assert (shape.sliding_window, shape.sliding_layers) == (Qwen2Config(**qwen2_no_key).sliding_window, (False, True))
    # Llama has no window in transformers: a stray key changes nothing.
    assert LlamaShape.from_config(llama_config(sliding_window=16)).sliding_window == 0
