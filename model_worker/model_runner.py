"""Owns the model weights and KV cache, and runs one scheduled step's forward pass.

Reads config.json + safetensors directly (no transformers model object), or builds random
weights from the config for benchmarks; returns the logits of rows that need a new token.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from model_worker.attention_metadata import AttentionMetadata
from model_worker.kv_cache import KVCache
from model_worker.models.llama import LlamaModel, LlamaShape
from model_worker.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # float32 on CPU keeps greedy outputs identical to transformers; bf16 on GPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def dummy_weights(shape: LlamaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the checkpoint's names and shapes (std 0.02, norms at 1)."""
    gen = torch.Generator().manual_seed(seed)
    s = shape

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen) * 0.02

    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    weights = {"model.embed_tokens.weight": rand(s.vocab_size, s.hidden_size),
               "model.norm.weight": torch.ones(s.hidden_size)}
    if not s.tie_word_embeddings:
        weights["lm_head.weight"] = rand(s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q, s.hidden_size),
            p + "self_attn.k_proj.weight": rand(kv, s.hidden_size),
            p + "self_attn.v_proj.weight": rand(kv, s.hidden_size),
            p + "self_attn.o_proj.weight": rand(s.hidden_size, q),
            p + "mlp.gate_proj.weight": rand(s.intermediate_size, s.hidden_size),
            p + "mlp.up_proj.weight": rand(s.intermediate_size, s.hidden_size),
            p + "mlp.down_proj.weight": rand(s.hidden_size, s.intermediate_size),
            p + "input_layernorm.weight": torch.ones(s.hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(s.hidden_size),
        })
        if s.attention_bias:
            weights.update({p + f"self_attn.{n}_proj.bias": rand(d) for n, d in (("q", q), ("k", kv), ("v", kv))})
    return weights


@dataclass
class StepLogits:
    logits: torch.Tensor  # [S, V] float32, one row per chunk that completes its sequence
    chunk_indices: list[int]  # index into SchedulerOutput.chunks for each row


class ModelRunner:
    def __init__(self, model_dir: Path, load_format: str, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.shape = LlamaShape.from_config(config)
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        # Rotary tables only need the positions we will ever use.
        self.shape.max_position_embeddings = max(self.shape.max_position_embeddings, max_model_len)
        weights = dummy_weights(self.shape) if load_format == "dummy" else load_weights(model_dir)
        self.model = LlamaModel(self.shape, weights, device, dtype)
        self.kv_cache = KVCache(self.shape.num_layers, max_num_seqs, self.shape.num_kv_heads, max_model_len,
                                self.shape.head_dim, dtype, device)
        kv_bytes = self.kv_cache.key.numel() * self.kv_cache.key.element_size() * 2
        logger.info("model %s on %s/%s, KV cache %d slots x %d tokens = %.1f MiB", model_dir.name, device,
                    dtype, max_num_seqs, max_model_len, kv_bytes / 2**20)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> StepLogits:
        input_ids: list[int] = []
        prefills: list[tuple[int, int, int]] = []
        decodes: list[tuple[int, int]] = []
        last_rows: list[int] = []
        chunk_indices: list[int] = []
        row = 0
        for i, chunk in enumerate(scheduled.chunks):
            input_ids.extend(chunk.seq.token_ids_from(chunk.start, chunk.num_tokens))
            if i < len(scheduled.prefills):
                prefills.append((chunk.seq.slot, chunk.start, chunk.num_tokens))
            else:
                decodes.append((chunk.seq.slot, chunk.start))
            row += chunk.num_tokens
            if chunk.completes_sequence:
                last_rows.append(row - 1)
                chunk_indices.append(i)
        meta = AttentionMetadata.build(prefills, decodes, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model.forward(ids, meta, self.kv_cache)  # [T, hidden]
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return StepLogits(self.model.logits(hidden[rows]), chunk_indices)
