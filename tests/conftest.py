"""Shared fixtures: the real SmolLM2 tokenizer/model directory and a tiny random model.

The tiny model keeps the fast suite fast; it uses the real SmolLM2 tokenizer so text paths
are exercised with real byte-level BPE pieces.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# As each service package does: tokenwire's __init__ chooses gRPC's socket layer before grpc is
# imported, so the tests' in-process servers and clients run on the services' one, whichever test
# module imports grpc first.
import tokenwire  # noqa: F401

CACHE_DIR = Path(os.environ.get("TOKENWIRE_CACHE_DIR", Path.home() / ".cache" / "tokenwire"))


def _import_triton_for_its_interpreter() -> None:
    """Without CUDA, tests/test_triton_ops.py runs the kernels in Triton's interpreter, which must be
    on when triton.language is first imported: its own helpers (tl.max, tl.sum...) are kernels too,
    and ones made for a GPU cannot run in the interpreter. torch._dynamo and transformers import
    triton along the way, so it is imported here first, then the variable is unset again so the
    processes the tests start do not inherit it."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_its_interpreter()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Converted SmolLM2-135M-Instruct (config, safetensors, tokenizer), cached on disk.

    TOKENWIRE_TEST_MODEL_DIR names a dir with its config and tokenizer instead, for a host
    without the GGUF's package (a GPU machine that only runs the tests on random weights)."""
    if os.environ.get("TOKENWIRE_TEST_MODEL_DIR"):
        return Path(os.environ["TOKENWIRE_TEST_MODEL_DIR"])
    from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir

    return resolve_model_dir(DEFAULT_MODEL, CACHE_DIR)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path):
    """The real SmolLM2 `tokenizers` Tokenizer (byte-level BPE)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def smollm2_decoding(smollm2):
    """The detok worker's byte tables for SmolLM2, built once per test session."""
    from detok_worker.token_bytes import TokenizerDecoding

    return TokenizerDecoding(smollm2)


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    """A 2-layer Llama config with SmolLM2's tokenizer; weights are built at load time
    (--load-format dummy), so nothing big is written."""
    out = tmp_path_factory.mktemp("tiny-llama")
    config = json.loads((smollm2_dir / "config.json").read_text())
    config.update(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2_dir / name).exists():
            (out / name).write_bytes((smollm2_dir / name).read_bytes())
    return out


@pytest.fixture
def head_dim_64_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny random Llama with 64-wide heads (the C++ kernels' sizes), 2 layers."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def tiny_stack(tiny_model_dir: Path, max_model_len: int, *model_worker_flags: str, **kwargs):
    """The three services on loopback over the tiny random model (a context manager); extra
    model worker flags after max_model_len."""
    from tokenwire.stack import start_stack

    return start_stack(["--model", str(tiny_model_dir), "--load-format", "dummy", "--max-num-seqs", "8",
                        "--max-model-len", str(max_model_len), "--device", "cpu", *model_worker_flags],
                       timeout_s=180, **kwargs)


@contextmanager
def tiny_model_worker(tiny_model_dir: Path, *flags: str) -> Iterator[str]:
    """A model worker process on the tiny random model (one torch thread, these extra flags),
    serving on a free loopback port; yields its address."""
    from tokenwire.stack import free_port, spawn, wait_grpc_serving

    port = free_port()
    proc = spawn("model_worker", "model_worker", [
        "--port", str(port), "--model", str(tiny_model_dir), "--load-format", "dummy", "--num-threads", "1",
        *flags])
    address = f"127.0.0.1:{port}"
    try:
        wait_grpc_serving(proc, address, 120)
        yield address
    finally:
        proc.stop()


def openai_client(gateway_url: str):
    import openai

    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The served model id, for modules whose `client` fixture is an openai.OpenAI on a stack."""
    (card,) = client.models.list().data
    return card.id
