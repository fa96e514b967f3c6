"""The GGUF conversion cache: one conversion however many processes start at once, no scratch
left behind, and the file's quantization types kept with the conversion (model_files.py). The
conversion itself is stubbed: transformers' de-quantization takes ~15 s and is not what is tested."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from model_worker import model_files


@pytest.fixture
def fake_conversion(monkeypatch):
    """model_files._convert_into writing a converted dir's files after a pause; returns the
    list of scratch dirs it converted into."""
    calls: list[Path] = []

    def convert_into(gguf: Path, scratch: Path) -> None:
        calls.append(scratch)
        time.sleep(0.2)
        if gguf.read_bytes() == b"broken":
            raise RuntimeError("conversion failed")
        for name in ("config.json", "tokenizer.json"):
            (scratch / name).write_text("{}")
        (scratch / "tokenwire_source.json").write_text(json.dumps(
            {"gguf": str(gguf), "layer_types": ["Q4_1"], "lm_head_type": "Q8_0"}))

    monkeypatch.setattr(model_files, "_convert_into", convert_into)
    return calls


def test_processes_starting_at_once_convert_once_and_leave_no_scratch(tmp_path, fake_conversion):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"weights")
    cache = tmp_path / "cache"
    results: list[Path] = []
    starts = [threading.Thread(target=lambda: results.append(model_files.convert_gguf(gguf, cache)))
              for _ in range(3)]
    for start in starts:
        start.start()
    for start in starts:
        start.join()
    assert len(fake_conversion) == 1 and len(set(results)) == 1 and len(results) == 3
    assert not list(cache.glob(".converting-*"))


def test_a_killed_conversions_scratch_is_removed_and_a_failed_ones_too(tmp_path, fake_conversion):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"broken")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="conversion failed"):
        model_files.convert_gguf(gguf, cache)
    assert not list(cache.glob(".converting-*"))
    gguf.write_bytes(b"weights")
    target_name = f"m-{model_files._gguf_cache_key(gguf, cache)}"
    killed = cache / f".converting-{target_name}-abc123"  # what a process killed half way leaves
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"x" * 1000)
    other = cache / ".converting-other-model-xyz"  # another model's, maybe converting right now
    other.mkdir()
    target = model_files.convert_gguf(gguf, cache)
    assert target.name == target_name and not killed.exists() and other.exists()


def test_quantization_types_outlive_the_file_converted(tmp_path, fake_conversion):
    # The cache is keyed by content: another checkout's copy of the file reuses the dir, after
    # the one recorded as its source is gone.
    gguf = tmp_path / "first" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"weights")
    target = model_files.convert_gguf(gguf, tmp_path / "cache")
    gguf.unlink()
    model_files.gguf_weight_types.cache_clear()
    assert model_files.gguf_weight_types(target) == ({"Q4_1"}, "Q8_0")


def test_the_tokenizers_eos_ends_outputs_too(tiny_model_dir, tmp_path):
    """As vLLM: generation_config's ids and the tokenizer's eos token (a ChatML fine-tune whose
    config still names <|endoftext|> ends its turns with <|im_end|>, the tokenizer's)."""
    import shutil

    from model_worker.__main__ import tokenizer_eos_id
    from model_worker.engine import default_eos_ids

    assert tokenizer_eos_id(tiny_model_dir) == 2  # SmolLM2's <|im_end|>
    assert default_eos_ids({"eos_token_id": 0}, {}, 2) == [0, 2]
    assert default_eos_ids({"eos_token_id": [2, 0]}, {}, 2) == [2, 0]
    assert default_eos_ids({}, {}, 2) == [2]  # no eos in either config: the tokenizer's still stops
    assert default_eos_ids({}, {"eos_token_id": 0}, None) == [0]
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", bare)
    assert tokenizer_eos_id(bare) is None  # no tokenizer_config.json
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert tokenizer_eos_id(bare) == 0
