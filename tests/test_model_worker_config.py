"""The model worker's flags that refuse each other (no model, no engine)."""

from __future__ import annotations

import pytest

from model_worker.config import Config
from tokenwire.config_cli import parse_config


def test_a_step_budget_below_the_running_sequences_is_refused():
    """Every running sequence decodes one token a step: with a smaller budget the newest would
    stall until the oldest finish (vLLM refuses it too)."""
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(16\) must be >= --max-num-seqs \(32\)"):
        Config(max_num_batched_tokens=16)
    assert parse_config(Config, ["--max-num-batched-tokens", "32"], env_prefix="TOKENWIRE_TEST_MWC_") \
        .max_num_batched_tokens == 32
