"""bench.hf_baselines end to end on the tiny model's config with transformers' random init
(--load-format dummy): both modes run the workload and report every token."""

from __future__ import annotations

import json

import pytest
import torch

from bench import hf_baselines


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_dummy_weights_run_the_workload(tiny_model_dir, tmp_path, mode):
    out = tmp_path / f"{mode}.json"
    code = hf_baselines.main(["--mode", mode, "--model", str(tiny_model_dir), "--load-format", "dummy",
                              "--concurrency", "2", "--output-tokens", "3", "--prompt-len", "8", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["error"] is None, report["error"]
    assert report["kind"] == f"hf_{mode}" and report["device"] == "cpu" and report["load_format"] == "dummy"
    [level] = report["levels"]
    assert level["concurrency"] == 2 and level["completed"] == 2
    assert level["total_output_tokens"] == 2 * 3


def test_dummy_weights_are_made_on_the_device_in_the_dtype(tiny_model_dir):
    # "meta" stands in for a GPU: a model made on the host and not moved would be on "cpu".
    model = hf_baselines.load_model(tiny_model_dir, "dummy", torch.device("meta"), torch.bfloat16)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert model.config.num_hidden_layers == config["num_hidden_layers"]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"meta"}
