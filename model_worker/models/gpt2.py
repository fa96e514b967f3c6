"""GPT-2 (GPT2LMHeadModel) over ragged token batches, reading and writing the paged KV cache.

Same interface as llama.LlamaModel: forward(input_ids [T], metadata, kv) -> hidden [T, E] and
logits(hidden); learned position embeddings, LayerNorm with bias, a fused qkv projection
stored as Conv1D ([in, out]) in checkpoints, and a tied lm_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from model_worker.attention_metadata import AttentionMetadata
from model_worker.kv_cache import PagedKVCache
from model_worker.models.activations import ACTIVATIONS
from model_worker.models.attention import paged_attention
from model_worker.models.linear import Linear

SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel",)

@dataclass
class GPT2Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_position_embeddings: int  # n_positions: learned embeddings, so a hard context limit
    activation: str
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @classmethod
    def from_config(cls, config: dict) -> GPT2Shape:
        archs = config.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"architectures {archs} not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if config.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention (add_cross_attention) is an encoder-decoder part, "
                             "not a causal LM this worker serves")
        activation = config.get("activation_function", "gelu_new")
        if activation not in ACTIVATIONS:
            raise ValueError(f"GPT-2 activation_function {activation!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        hidden = config.get("n_embd") or config["hidden_size"]
        num_heads = config.get("n_head") or config["num_attention_heads"]
        if hidden % num_heads:
            raise ValueError(f"GPT-2 n_embd {hidden} is not a multiple of n_head {num_heads}")
        # reorder_and_upcast_attn only changes rounding (scores in float32): SDPA accumulates in
        # float32 anyway, so it needs nothing here.
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config.get("n_inner") or 4 * hidden,
            num_layers=config.get("n_layer") or config["num_hidden_layers"],
            num_heads=num_heads,
            layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
            max_position_embeddings=config.get("n_positions") or config.get("max_position_embeddings", 1024),
            activation=activation,
            scale_attn_weights=config.get("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=config.get("scale_attn_by_inverse_layer_idx", False),
            tie_word_embeddings=config.get("tie_word_embeddings", True),
        )

    def attention_scale(self, layer: int) -> float:
        """transformers' GPT2Attention.scaling: 1/sqrt(D) unless scale_attn_weights is off,
        further divided by layer + 1 with scale_attn_by_inverse_layer_idx."""
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        return scale


def checkpoint_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without the 'transformer.' prefix (GPT2Model checkpoints, like OpenAI's own gpt2,
    have none; GPT2LMHeadModel ones do); the causal-mask buffers old checkpoints carry dropped."""
    out = {}
    for name, tensor in weights.items():
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        out[name] = tensor
    return out


def dummy_weights(shape: GPT2Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with GPT2LMHeadModel's names and Conv1D shapes (std 0.02, norms at 1)."""
    gen = torch.Generator().manual_seed(seed)
    s = shape
    e, inner = s.hidden_size, s.intermediate_size

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen) * 0.02

    weights = {"transformer.wte.weight": rand(s.vocab_size, e),
               "transformer.wpe.weight": rand(s.max_position_embeddings, e),
               "transformer.ln_f.weight": torch.ones(e), "transformer.ln_f.bias": torch.zeros(e)}
    if not s.tie_word_embeddings:
        weights["lm_head.weight"] = rand(s.vocab_size, e)
    for i in range(s.num_layers):
        p = f"transformer.h.{i}."
        weights.update({
            p + "ln_1.weight": torch.ones(e), p + "ln_1.bias": torch.zeros(e),
            p + "attn.c_attn.weight": rand(e, 3 * e), p + "attn.c_attn.bias": rand(3 * e),
            p + "attn.c_proj.weight": rand(e, e), p + "attn.c_proj.bias": rand(e),
            p + "ln_2.weight": torch.ones(e), p + "ln_2.bias": torch.zeros(e),
            p + "mlp.c_fc.weight": rand(e, inner), p + "mlp.c_fc.bias": rand(inner),
            p + "mlp.c_proj.weight": rand(inner, e), p + "mlp.c_proj.bias": rand(e),
        })
    return weights


class GPT2Model:
    """Weights as plain tensors; forward(input_ids [T], metadata) -> hidden [T, E]."""

    def __init__(self, shape: GPT2Shape, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, int8_small_batch: bool = False, int8_kernel: ModuleType | None = None,
                 bf16_kernel: ModuleType | None = None, bf16_large_steps: str = "onednn") -> None:
        """bf16_kernel, bf16_large_steps: see Linear."""
        self.shape = shape
        self.device = device
        self.dtype = dtype
        s = shape
        weights = checkpoint_names(weights)

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        def conv1d(name: str) -> Linear:
            # Conv1D stores [in, out]; Linear wants [out, in] for F.linear.
            weight = weights.pop(name + ".weight").t().to(device=device, dtype=dtype).contiguous()
            return Linear(weight, take(name + ".bias"), int8_small_batch, 0, int8_kernel, bf16_kernel, bf16_large_steps)

        self.wte = take("wte.weight")  # [V, E]
        self.wpe = take("wpe.weight")  # [n_positions, E]
        self.layers = []
        for i in range(s.num_layers):
            p = f"h.{i}."
            self.layers.append({
                "ln_1": (take(p + "ln_1.weight"), take(p + "ln_1.bias")),
                "qkv": conv1d(p + "attn.c_attn"),  # [3E, E]: q, k, v in that order
                "o": conv1d(p + "attn.c_proj"),
                "ln_2": (take(p + "ln_2.weight"), take(p + "ln_2.bias")),
                "fc": conv1d(p + "mlp.c_fc"),
                "proj": conv1d(p + "mlp.c_proj"),
                "scale": s.attention_scale(i),
            })
        self.ln_f = (take("ln_f.weight"), take("ln_f.bias"))
        head = self.wte if s.tie_word_embeddings or "lm_head.weight" not in weights else take("lm_head.weight")
        self.lm_head = Linear(head, None, int8_small_batch, 0, int8_kernel, bf16_kernel, bf16_large_steps)
        self.act = ACTIVATIONS[s.activation]

    def _layer_norm(self, x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.shape.hidden_size,), *weight_bias, self.shape.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache) -> torch.Tensor:
        s = self.shape
        num_tokens = input_ids.shape[0]
        x = F.embedding(input_ids, self.wte) + F.embedding(meta.positions, self.wpe)  # [T, E]
        for i, layer in enumerate(self.layers):
            h = self._layer_norm(x, layer["ln_1"])
            q, k, v = layer["qkv"](h).view(num_tokens, 3, s.num_heads, s.head_dim).unbind(1)  # [T, H, D] each
            kv.write(i, meta.slot_mapping, k, v)
            attn = paged_attention(i, q, k, v, meta, kv, layer["scale"])  # [T, E]
            x = x + layer["o"](attn)
            h = self._layer_norm(x, layer["ln_2"])
            x = x + layer["proj"](self.act(layer["fc"](h)))
        return self._layer_norm(x, self.ln_f)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, E] -> logits [S, V] in float32 for the sampler."""
        return self.lm_head(hidden).float()
