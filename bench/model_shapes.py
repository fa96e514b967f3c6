"""Model directories of public architectures' shapes for benchmarks with dummy weights.

A directory holds config.json and a tokenizer (SmolLM2's by default: its ids are valid in any
larger vocabulary), so both `--load-format dummy` in the model worker and transformers'
`from_config` can build the model, and the load generators can make prompts. Nothing is downloaded.

    python -m bench.model_shapes llama3-8b /tmp/llama3-8b-shape
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# config.json values of the public checkpoints (their weights are never needed).
SHAPES = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_shape_dir(shape: str, out: Path, tokenizer_dir: Path | None = None) -> Path:
    """out/config.json of `shape`, plus tokenizer_dir's tokenizer files when given."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
    out.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape])
    if tokenizer_dir is not None and (tokenizer_dir / "config.json").is_file():
        # The special ids of the tokenizer that comes along, not the public checkpoint's (Llama 3's
        # EOS 128001 is no id of SmolLM2's tokenizer, and structured output checks it).
        source = json.loads((tokenizer_dir / "config.json").read_text())
        config.update({key: source[key] for key in ("bos_token_id", "eos_token_id") if key in source})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer-from", default="default",
                        help="a model dir whose tokenizer to copy; 'default': SmolLM2's (converted once from its GGUF)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tokenwire"))
    args = parser.parse_args(argv)
    if args.tokenizer_from == "default":
        from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir

        tokenizer_dir = resolve_model_dir(DEFAULT_MODEL, Path(args.cache_dir))
    else:
        tokenizer_dir = Path(args.tokenizer_from)
    print(write_shape_dir(args.shape, args.out, tokenizer_dir))


if __name__ == "__main__":
    main()
