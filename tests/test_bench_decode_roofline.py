"""bench.decode_roofline on the CPU: the bytes it counts follow the model's arithmetic, and its
roofline and ratios follow from them and the measured bandwidth."""

from __future__ import annotations

import json

import pytest

from bench import decode_roofline
from bench.model_shapes import write_shape_dir


def llama_weight_elements(config: dict) -> int:
    """Elements one decode step reads: every layer's q/k/v/o, gate/up/down and two norms, the final
    norm and the LM head (the embedding matrix when tied)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = (q + 2 * kv) * hidden + hidden * q + 2 * inter * hidden + hidden * inter + 2 * hidden
    return config["num_hidden_layers"] * per_layer + hidden + config["vocab_size"] * hidden


def test_cpu_run_counts_the_model_arithmetic(tiny_model_dir, tmp_path):
    out = tmp_path / "roofline.json"
    report = decode_roofline.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                                   "--batch-sizes", "1,3", "--context", "20", "--steps", "4", "--warmup", "1",
                                   "--bandwidth-bytes", str(8 << 20), "--json", str(out)])
    assert json.loads(out.read_text()) == report
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = config["head_dim"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # float32
    assert report["kv_bytes_per_token"] == per_token
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    assert bandwidth > 0
    for result, batch in zip(report["results"], (1, 3), strict=True):
        assert result["batch"] == batch
        assert result["weight_bytes"] == 4 * llama_weight_elements(config)
        # Timed steps run at contexts 21..24 (the prompt, its first token, then one more per step).
        assert 20 < result["mean_context"] < 20 + 1 + 4 + 2
        assert result["kv_bytes"] == round(batch * (result["mean_context"] + 1) * per_token)
        assert result["roofline_ms"] == pytest.approx(1e3 * (result["weight_bytes"] + result["kv_bytes"]) / bandwidth)
        assert set(result["step_ms"]) == {"eager"}  # no CUDA graphs on a CPU
        assert result["step_ms"]["eager"] > 0
        assert result["ratio"]["eager"] == pytest.approx(result["step_ms"]["eager"] / result["roofline_ms"])


def test_the_built_in_shapes_are_the_public_configs(tmp_path):
    config = json.loads(write_shape_dir("llama3-8b", tmp_path).joinpath("config.json").read_text())
    # Llama-3-8B has 8,030,261,248 parameters; the input embedding (525M) is read only by its rows.
    assert llama_weight_elements(config) + config["vocab_size"] * config["hidden_size"] == 8_030_261_248


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        decode_roofline.parse_args(["--batch-sizes", "0"])
    with pytest.raises(SystemExit):
        decode_roofline.parse_args(["--steps", "0"])


def test_bf16_kernel_steps_are_timed_beside_the_eager_ones(tiny_model_dir):
    from model_worker import kernels

    if kernels.bf16_linear_module() is None:
        with pytest.raises(SystemExit, match="no bf16 kernel here"):
            decode_roofline.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--dtype", "bfloat16",
                                  "--batch-sizes", "1", "--context", "8", "--steps", "2", "--warmup", "0",
                                  "--bandwidth-bytes", str(8 << 20), "--bf16-small-batch"])
        return
    report = decode_roofline.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--dtype", "bfloat16",
                                   "--batch-sizes", "1,2", "--context", "8", "--steps", "3", "--warmup", "1",
                                   "--bandwidth-bytes", str(8 << 20), "--bf16-small-batch"])
    config = json.loads((tiny_model_dir / "config.json").read_text())
    for result in report["results"]:
        assert set(result["step_ms"]) == {"eager", "bf16_kernel"}
        assert result["step_ms"]["bf16_kernel"] > 0
        # One copy of the weights counted, in bf16, whichever path reads it.
        assert result["weight_bytes"] == 2 * llama_weight_elements(config)


def test_bf16_kernel_steps_need_bf16_weights(tiny_model_dir):
    with pytest.raises(SystemExit, match="no bf16 kernel here"):
        decode_roofline.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                              "--batch-sizes", "1", "--context", "8", "--steps", "2", "--warmup", "0",
                              "--bandwidth-bytes", str(8 << 20), "--bf16-small-batch"])
