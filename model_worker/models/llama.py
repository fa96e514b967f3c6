"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over ragged token batches.

Linear layers run on all of a step's tokens at once ([T, hidden]); only attention splits by
sequence, reading and writing the paged KV cache through block tables, so prefill chunks and
decodes share a step.
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
from model_worker.models.batch_invariant_attention import per_query_attention
from model_worker.models.linear import BATCH_INVARIANT_ROW_TILE, Linear
from model_worker.models.rope import RopeScaling, inv_freq_and_attention_factor

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v have biases
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    o_bias: bool = False  # o_proj has a bias (Llama's and Qwen3's attention_bias; never Qwen2's)
    mlp_bias: bool = False  # gate, up and down have biases (Llama's mlp_bias)
    hidden_act: str = "silu"  # the MLP's activation, a transformers ACT2FN name
    # A query at position p sees keys p - sliding_window < k <= p in the layers marked True
    # (Mistral: all of them; Qwen2/3: layer_types). 0 and () when every layer attends fully.
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()

    @classmethod
    def from_config(cls, config: dict) -> LlamaShape:
        archs = config.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"architectures {archs} not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = config["num_attention_heads"]
        sliding_window, sliding_layers = parse_sliding_window(config, archs)
        # The biases each family's transformers class builds: Qwen2's q, k and v always, its
        # o_proj never; Llama and Qwen3 all four with attention_bias; Mistral none, whatever its
        # config says; mlp_bias is Llama's alone. One left out would leave its weights unread and
        # every logit wrong (load_weights refuses weights it did not read).
        llama_or_qwen3 = "LlamaForCausalLM" in archs or "Qwen3ForCausalLM" in archs
        attention_bias = bool(config.get("attention_bias", False)) and llama_or_qwen3
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} not supported; supported: {', '.join(ACTIVATIONS)}")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope=RopeScaling.from_config(config),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=attention_bias or "Qwen2ForCausalLM" in archs,
            qk_norm="Qwen3ForCausalLM" in archs,
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) and "LlamaForCausalLM" in archs,
            hidden_act=hidden_act,
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
        )


# transformers' default sliding_window for Mistral, Qwen2 and Qwen3 configs that leave it out.
CONFIG_DEFAULT_SLIDING_WINDOW = 4096


def parse_sliding_window(config: dict, archs: list[str]) -> tuple[int, tuple[bool, ...]]:
    """(window, which layers use it) as transformers reads the config: Mistral windows every
    layer when sliding_window is set; Qwen2/3 only with use_sliding_window, in the layers
    layer_types names "sliding_attention" (by default those from max_window_layers on);
    Llama has no window."""
    num_layers = config["num_hidden_layers"]
    # A config.json without the key gets MistralConfig's / Qwen2Config's default; null is no window.
    window = config.get("sliding_window", CONFIG_DEFAULT_SLIDING_WINDOW)
    if "MistralForCausalLM" in archs:
        if config.get("layer_types"):
            # transformers' Mistral ignores layer_types (Ministral is the alternating model).
            raise ValueError("Mistral with layer_types (alternating attention) is not supported")
        layers = (True,) * num_layers
    elif "Qwen2ForCausalLM" in archs or "Qwen3ForCausalLM" in archs:
        if not config.get("use_sliding_window"):
            return 0, ()
        layer_types = config.get("layer_types") or [
            "sliding_attention" if window is not None and i >= config.get("max_window_layers", 28)
            else "full_attention" for i in range(num_layers)]
        unknown = set(layer_types) - {"sliding_attention", "full_attention"}
        if unknown or len(layer_types) != num_layers:
            raise ValueError(f"layer_types {layer_types} must name 'sliding_attention' or 'full_attention' "
                             f"for each of the {num_layers} layers")
        layers = tuple(t == "sliding_attention" for t in layer_types)
    else:
        return 0, ()
    if window is None or not any(layers):
        return 0, ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    return window, layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised in float32 whatever the model dtype, then cast and scaled, as transformers
    # does; F.rms_norm is one fused op where the spelled-out formula is five.
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (the fused gate and up projections) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_activation(hidden_act: str):
    """gate_up [T, 2I] -> act(gate) * up [T, I] for an activation other than SiLU."""
    act = ACTIVATIONS[hidden_act]

    def apply(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up
    return apply


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the norm after it."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights as plain tensors; forward(input_ids [T], metadata) -> hidden [T, hidden]."""

    def __init__(self, shape: LlamaShape, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, int8_small_batch: bool = False, batch_invariant: bool = False,
                 int8_kernel: ModuleType | None = None, llama_ops: ModuleType | None = None,
                 bf16_kernel: ModuleType | None = None, bf16_large_steps: str = "onednn",
                 gguf_kernel: ModuleType | None = None, gguf_lm_head: str | None = None) -> None:
        """int8_kernel, llama_ops, bf16_kernel: kernels.int8_linear_module(), kernels.llama_ops_module()
        and kernels.bf16_linear_module() (--bf16-small-batch, --cpu-bf16-matmul kernels), which the
        caller passes only for bf16 weights on the CPU (ModelRunner), or None for torch ops.
        bf16_large_steps: see Linear. gguf_kernel: kernels.gguf_linear_module() for --int4-small-batch
        (the decoder layers' matmuls in Q4_1), or None; gguf_lm_head: the lm_head's small-step format
        with it ("q8_0": a Q8_0 file's own head), or None to keep its weights' precision."""
        self.shape = shape
        self.device = device
        self.dtype = dtype
        s = shape
        # --batch-invariant: fixed-shape GEMMs and per-query attention, so a token's hidden
        # states (and logits) are bitwise the same whatever shares its step.
        row_tile = BATCH_INVARIANT_ROW_TILE if batch_invariant else 0
        self.attention = per_query_attention if batch_invariant else paged_attention

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        def take_loaded(name: str) -> torch.Tensor:
            """As loaded (precision and device), for a GGUF-format copy's quantization; linear()
            converts it, so a float32 checkpoint never reaches a GPU in float32."""
            return weights.pop(name)

        def linear(loaded: torch.Tensor, bias: torch.Tensor | None = None, gguf_format: str | None = "q4_1",
                   weight: torch.Tensor | None = None) -> Linear:
            """loaded: the weight as take_loaded gives it; weight: its copy in dtype, if there is one."""
            kernel = gguf_kernel if gguf_format else None
            weight = loaded.to(device=device, dtype=dtype).contiguous() if weight is None else weight
            return Linear(weight, bias, int8_small_batch, row_tile, int8_kernel, bf16_kernel, bf16_large_steps,
                          kernel, loaded if kernel is not None else None, gguf_format or "q4_1")

        embed_loaded = take_loaded("model.embed_tokens.weight")
        self.embed = embed_loaded.to(device=device, dtype=dtype).contiguous()  # [V, hidden]
        self.layers = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            # q, k and v share one matmul: one GEMM of [T, hidden] x [hidden, (H + 2 Hkv) D]
            # costs less than three on small batches, where per-op overhead dominates.
            qkv = torch.cat([take_loaded(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_bias = (torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                        if s.attention_bias else None)
            gate_up = torch.cat([take_loaded(p + "mlp.gate_proj.weight"), take_loaded(p + "mlp.up_proj.weight")])
            gate_up_bias = (torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
                            if s.mlp_bias else None)
            self.layers.append({
                "input_norm": take(p + "input_layernorm.weight"),
                "qkv": linear(qkv, qkv_bias),
                "o": linear(take_loaded(p + "self_attn.o_proj.weight"),
                            take(p + "self_attn.o_proj.bias") if s.o_bias else None),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                "gate_up": linear(gate_up, gate_up_bias),
                "down": linear(take_loaded(p + "mlp.down_proj.weight"),
                               take(p + "mlp.down_proj.bias") if s.mlp_bias else None),
            })
            if s.qk_norm:
                # q's and k's per-head norm weights stacked [H + Hkv, D], to norm qk in one op.
                self.layers[-1]["qk_norm"] = torch.cat([take(p + "self_attn.q_norm.weight").expand(s.num_heads, -1),
                                                        take(p + "self_attn.k_norm.weight").expand(s.num_kv_heads, -1)])
        self.norm = take("model.norm.weight")
        # The lm_head keeps its weights' precision: bf16, or its GGUF file's own format.
        if s.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = linear(embed_loaded, gguf_format=gguf_lm_head, weight=self.embed)
        else:
            self.lm_head = linear(take_loaded("lm_head.weight"), gguf_format=gguf_lm_head)
        del embed_loaded
        # A tensor of the checkpoint this forward never reads is a part of the model it would
        # leave out (a bias, a norm of a variant), every logit silently wrong: refused instead.
        unread = sorted(name for name in weights if not name.endswith("rotary_emb.inv_freq")
                        and not (name == "lm_head.weight" and s.tie_word_embeddings))
        if unread:
            raise ValueError(f"the checkpoint has weights the Llama-family forward does not read "
                             f"({len(unread)}: {', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''})")
        # Rotary tables in float32 for every position, computed as transformers computes
        # them (outer product in float32, cos/sin, then cast) so positions match exactly.
        # Scaled rope types change inv_freq, and yarn scales cos and sin (attention_factor).
        inv_freq, attention_factor = inv_freq_and_attention_factor(s.rope, s.head_dim, s.max_position_embeddings)
        pos = torch.arange(s.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)  # [max_pos, D]
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)
        self.sliding_layers = s.sliding_layers or (False,) * s.num_layers
        self.scale = 1.0 / math.sqrt(s.head_dim)
        # On a bf16 CPU, a layer's small ops as C++ calls (kernels/llama_ops.cpp; several torch ops
        # each otherwise, most of a one-token step's time outside the matmuls): the hidden-size
        # norms, each fused with the residual add before it, and the rotary embedding with the KV
        # cache write (not where q and k are normed first, nor at a head size it does not take),
        # and the MLP's activation.
        self.rms_norm = llama_ops.rms_norm if llama_ops is not None else rms_norm
        self.add_rms_norm = llama_ops.add_rms_norm if llama_ops is not None else add_rms_norm
        self.act_and_mul = llama_ops.silu_and_mul if llama_ops is not None else silu_and_mul
        if s.hidden_act not in ("silu", "swish"):
            self.act_and_mul = gated_activation(s.hidden_act)  # the kernels' op is SiLU's alone
        # The C++ op takes head sizes in multiples of 32, the Triton one powers of two (its rope_fits).
        rope_fits = not s.qk_norm and (llama_ops.rope_fits(s.head_dim) if hasattr(llama_ops, "rope_fits")
                                       else s.head_dim % 32 == 0)
        self.rope_and_cache = llama_ops.rope_and_cache if llama_ops is not None and rope_fits else None

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache) -> torch.Tensor:
        s = self.shape
        num_tokens = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        rope_and_cache = self.rope_and_cache
        if rope_and_cache is None:
            cos = self.cos.index_select(0, meta.positions)[:, None, :]  # [T, 1, D]
            sin = self.sin.index_select(0, meta.positions)[:, None, :]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        eps = s.rms_norm_eps
        h = self.rms_norm(x, self.layers[0]["input_norm"], eps)
        for i, layer in enumerate(self.layers):
            qkv = layer["qkv"](h)  # [T, (H + 2 Hkv) D]
            v = qkv[:, q_size + kv_size:].view(num_tokens, s.num_kv_heads, s.head_dim)
            if rope_and_cache is not None:
                qk = rope_and_cache(qkv, meta.positions, self.cos, self.sin, kv.layer_keys[i], kv.layer_values[i],
                                    meta.slot_mapping, s.num_heads, s.num_kv_heads)  # [T, H + Hkv, D]
            else:
                # Rotary on q and k together ([T, H + Hkv, D]): half the ops of two separate
                # calls, which matters at decode, where per-op overhead is most of the step.
                qk = qkv[:, :q_size + kv_size].view(num_tokens, s.num_heads + s.num_kv_heads, s.head_dim)
                if s.qk_norm:
                    qk = rms_norm(qk, layer["qk_norm"], s.rms_norm_eps)
                qk = qk * cos + rotate_half(qk) * sin
                kv.write(i, meta.slot_mapping, qk[:, s.num_heads:], v)
            q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
            attn = self.attention(i, q, k, v, meta, kv, self.scale, self.sliding_layers[i])  # [T, H * D]
            x, h = self.add_rms_norm(x, layer["o"](attn), layer["post_norm"], eps)
            next_norm = self.layers[i + 1]["input_norm"] if i + 1 < len(self.layers) else self.norm
            x, h = self.add_rms_norm(x, layer["down"](self.act_and_mul(layer["gate_up"](h))), next_norm, eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, V] in float32 for the sampler."""
        return self.lm_head(hidden).float()
