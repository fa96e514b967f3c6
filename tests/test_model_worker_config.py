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


@pytest.mark.parametrize(("config", "context"), [
    ({"max_position_embeddings": 1024}, 1024),
    ({"n_positions": 64}, 64),  # GPT-2
    ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048),  # the smallest, as vLLM
    ({"text_config": {"max_position_embeddings": 512}}, 512),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, 16384),
    ({"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32768}}, 131072),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({}, 2048),
])
def test_the_models_context_is_read_as_vllm_reads_it(config, context):
    from model_worker.__main__ import model_context_len

    assert model_context_len(config) == context


def test_a_max_model_len_past_the_models_positions_is_refused(tiny_model_dir):
    # An OPT-like model's learned positions ran out inside a step (IndexError), failing every
    # request of it; rotary models ran on angles they were never trained on.
    from model_worker.__main__ import build_engine

    with pytest.raises(ValueError, match="--max-model-len 2048 is beyond the model's context of 1024 tokens"):
        build_engine(Config(model=str(tiny_model_dir), load_format="dummy", max_model_len=2048,
                            keep_freed_host_memory=False))


def test_a_model_dir_without_a_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path):
    import shutil

    from model_worker.__main__ import check_served_model_files
    from model_worker.model_files import ModelNotFoundError

    check_served_model_files(str(tiny_model_dir))
    check_served_model_files("default")
    shutil.copy(tiny_model_dir / "config.json", tmp_path)
    with pytest.raises(ModelNotFoundError, match="no tokenizer.json"):
        check_served_model_files(str(tmp_path))


@pytest.mark.parametrize(("service", "argv"), [
    ("gateway", ["--log-level", "verbose"]),  # logging's traceback at start, or uvicorn's KeyError for "warn"
    ("gateway", ["--log-level", "warn"]),
    ("gateway", ["--request-timeout-s", "nan"]),  # every request a 504 at once
    ("gateway", ["--model-worker-dns-refresh-s", "inf"]),
    ("model_worker", ["--gpu-memory-utilization", "nan"]),
    ("detok_worker", ["--log-level", "trace"]),
])
def test_flags_without_a_meaning_are_refused_at_parse(service, argv, capsys):
    import importlib

    config_class = importlib.import_module(f"{service}.config").Config
    with pytest.raises(SystemExit):
        parse_config(config_class, argv, env_prefix="TOKENWIRE_TEST_FLAGS_")
    assert "error: --" in capsys.readouterr().err


def test_log_level_is_taken_in_any_case():
    from gateway.config import Config as GatewayConfig

    assert parse_config(GatewayConfig, ["--log-level", "WARNING"], env_prefix="TOKENWIRE_TEST_FLAGS_").log_level == \
        "warning"


def test_help_shows_each_flags_default(capsys: pytest.CaptureFixture[str]) -> None:
    """The parser's own defaults are None (the environment comes between a flag and the field's
    default), so argparse showed none; README sends operators to --help for them (review 104)."""
    from gateway.config import Config as GatewayConfig
    with pytest.raises(SystemExit):
        parse_config(Config, ["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for text in ("(default: 32) [env TOKENWIRE_MAX_NUM_SEQS]", "(default: 2048) [env TOKENWIRE_MAX_NUM_BATCHED_TOKENS]",
                 "(default: 1024) [env TOKENWIRE_MAX_WAITING_REQUESTS]"):
        assert text in shown
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, ["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1:50051)" in shown and "(default: 30) [env TOKENWIRE_DRAIN_GRACE_S]" in shown
    assert "(default: off) [env TOKENWIRE_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE]" in shown
    assert "[env TOKENWIRE_API_KEY]" in shown and "(default: ) [env TOKENWIRE_API_KEY]" not in shown  # empty: none
