"""Owns the model weights and KV cache, and runs one scheduled step's forward pass.

Reads config.json + safetensors directly (no transformers model object), or builds random
weights from the config for benchmarks; returns the logits of rows that need a new token.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from model_worker.attention_metadata import AttentionMetadata
from model_worker.kv_cache import PagedKVCache, kv_bytes_per_token, num_kv_blocks
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


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 dot products in hardware (AVX512-BF16 or AMX).

    Without them oneDNN emulates bf16 and is slower than float32, so "auto" must not pick it.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 wherever the hardware runs it natively: on this project's AVX512-BF16 CPUs its
        # GEMMs measured 3.4-6x faster than float32 at 32 tokens (bench/README.md), and it halves
        # the KV cache. float32 elsewhere on CPU; --dtype float32 gives transformers' exact greedy.
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
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
    # Extra output, only for chunks whose sequence asked for prompt logprobs.
    prompt_logits: list[PromptChunkLogits] = field(default_factory=list)


@dataclass
class PromptChunkLogits:
    """Logits after every prompt position of one chunk that predicts another prompt token."""

    chunk_index: int  # into SchedulerOutput.chunks
    first_position: int  # row j follows prompt position first_position + j
    logits: torch.Tensor  # [n, V] float32


class ModelRunner:
    def __init__(self, model_dir: Path, load_format: str, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, block_size: int = 16, kv_cache_tokens: int = 0,
                 kv_cache_memory_bytes: int = 0, gpu_memory_utilization: float = 0.9,
                 int8_small_batch: bool = False) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.shape = LlamaShape.from_config(config)
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        # Rotary tables only need the positions we will ever use.
        self.shape.max_position_embeddings = max(self.shape.max_position_embeddings, max_model_len)
        weights = dummy_weights(self.shape) if load_format == "dummy" else load_weights(model_dir)
        self.model = LlamaModel(self.shape, weights, device, dtype, int8_small_batch)
        s = self.shape
        # Sized after the weights are on the device, so a CUDA budget sees what is left.
        num_blocks = num_kv_blocks(kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, dtype), block_size,
                                   max_num_seqs, max_model_len, device, kv_cache_tokens, kv_cache_memory_bytes,
                                   gpu_memory_utilization)
        self.kv_cache = PagedKVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype, device)
        logger.info("model %s on %s/%s, KV cache %d blocks x %d tokens = %.1f MiB", model_dir.name, device,
                    dtype, num_blocks, block_size, self.kv_cache.num_bytes / 2**20)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> StepLogits:
        input_ids: list[int] = []
        prefills: list[tuple[list[int], int, int]] = []
        decodes: list[tuple[list[int], int]] = []
        last_rows: list[int] = []
        chunk_indices: list[int] = []
        row = 0
        for i, chunk in enumerate(scheduled.chunks):
            input_ids.extend(chunk.seq.token_ids_from(chunk.start, chunk.num_tokens))
            if i < len(scheduled.prefills):
                prefills.append((chunk.seq.block_table, chunk.start, chunk.num_tokens))
            else:
                decodes.append((chunk.seq.block_table, chunk.start))
            row += chunk.num_tokens
            if chunk.completes_sequence:
                last_rows.append(row - 1)
                chunk_indices.append(i)
        if scheduled.block_copies:
            src = torch.tensor([c.src for c in scheduled.block_copies], device=self.device)
            dst = torch.tensor([c.dst for c in scheduled.block_copies], device=self.device)
            self.kv_cache.copy_blocks(src, dst)
        meta = AttentionMetadata.build(prefills, decodes, self.kv_cache.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model.forward(ids, meta, self.kv_cache)  # [T, hidden]
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return StepLogits(self.model.logits(hidden[rows]), chunk_indices, self._prompt_logits(scheduled, hidden))

    def _prompt_logits(self, scheduled: SchedulerOutput, hidden: torch.Tensor) -> list[PromptChunkLogits]:
        """hidden [T, hidden] -> logits of the prompt positions of chunks that want prompt logprobs
        (rows are laid out in chunk order, as execute() built them)."""
        out: list[PromptChunkLogits] = []
        row = 0
        for i, chunk in enumerate(scheduled.chunks):
            seq = chunk.seq
            # Position p predicts p + 1; only predictions of prompt tokens are prompt logprobs.
            n = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1) - chunk.start
            # Not again for a prompt recomputed after preemption: its logprobs went out already.
            if seq.sampling.prompt_logprobs is not None and not seq.output_token_ids and n > 0:
                out.append(PromptChunkLogits(i, chunk.start, self.model.logits(hidden[row:row + n])))
            row += chunk.num_tokens
        return out
