"""Rotary position embedding parameters for the Llama family: config.json's rope_parameters /
rope_scaling parsed into RopeScaling, then the inverse frequencies llama.py builds its tables from.

Each rope_type computes inv_freq and the cos/sin scale exactly as transformers'
modeling_rope_utils does, so positions match it bit for bit in float32. A type not done here
is refused by name at parse time, never run as plain RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class RopeScaling:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    theta: float
    # The checkpoint's own max_position_embeddings: "dynamic" rescales beyond it (and is only
    # served up to it), "llama3" and "yarn" default their original length to it.
    max_position_embeddings: int
    factor: float = 1.0
    # llama3: the wavelength band that is interpolated, and the pretraining length it is cut at.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn: the ramp's rotation bounds, whether they are rounded out to whole dims, and the
    # cos/sin scale (None: derived from factor, mscale and mscale_all_dim as the paper does).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @classmethod
    def from_config(cls, config: dict) -> RopeScaling:
        """rope_parameters (transformers >= 5) or rope_scaling (older checkpoints), with
        rope_theta inside it or at the top level."""
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type rope parameters ({', '.join(params)}) are not supported")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (rotary over the whole head only)")
        max_pos = config.get("max_position_embeddings", 2048)
        scaling = cls(rope_type=rope_type, theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
                      max_position_embeddings=max_pos)
        if rope_type == "default":
            return scaling
        # Phi-3-style checkpoints keep the pretraining length at the top level; transformers
        # gives that one priority over the one inside the rope dict.
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        scaling.original_max_position_embeddings = int(original or max_pos)
        factor = params.get("factor")
        if factor is None and rope_type != "yarn":
            raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
        # yarn without a factor stretches max_position_embeddings over the original length.
        scaling.factor = float(factor if factor is not None else max_pos / scaling.original_max_position_embeddings)
        if rope_type == "llama3":
            missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
            if missing:
                raise ValueError(f"rope scaling 'llama3' needs {', '.join(missing)}")
            scaling.low_freq_factor = float(params["low_freq_factor"])
            scaling.high_freq_factor = float(params["high_freq_factor"])
        if rope_type == "yarn":
            # `or`, as transformers reads them: a null in config.json means the default.
            scaling.beta_fast = float(params.get("beta_fast") or 32)
            scaling.beta_slow = float(params.get("beta_slow") or 1)
            scaling.truncate = bool(params.get("truncate", True))
            scaling.attention_factor = params.get("attention_factor")
            scaling.mscale = params.get("mscale")
            scaling.mscale_all_dim = params.get("mscale_all_dim")
        return scaling


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[D / 2] float32: theta ** (-2i / D)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def inv_freq_and_attention_factor(rope: RopeScaling, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """inv_freq [D / 2] float32 and the factor cos and sin are multiplied by, for tables
    covering positions [0, max_positions)."""
    inv_freq = default_inv_freq(rope.theta, head_dim)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        # Dividing the frequencies by factor is dividing every position by it.
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        # transformers recomputes the base from the longest position of each forward once it
        # passes max_position_embeddings, and keeps it for later forwards: its result beyond
        # that length depends on the history of batch shapes, which a shared ragged step cannot
        # reproduce per sequence. Up to it, the frequencies are the unscaled ones.
        if max_positions > rope.max_position_embeddings:
            raise ValueError(f"dynamic (NTK) rope scaling is served only up to the checkpoint's "
                             f"max_position_embeddings {rope.max_position_embeddings}, where it is plain RoPE; "
                             f"lower --max-model-len from {max_positions}")
        # The base at seq_len = max_position_embeddings, spelled as transformers spells it (a
        # factor like 1.7 leaves it a few ulps off theta, and positions should match exactly).
        length = rope.max_position_embeddings
        base = rope.theta * ((rope.factor * length / length) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
        return default_inv_freq(base, head_dim), 1.0
    if rope.rope_type == "llama3":
        return llama3_inv_freq(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, head_dim), yarn_attention_factor(rope)
    raise ValueError(f"rope scaling {rope.rope_type!r} is not supported")


def llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor are divided by factor,
    shorter than original / high_freq_factor kept, and the band between blended smoothly."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_attention_factor(rope: RopeScaling) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def yarn_inv_freq(rope: RopeScaling, head_dim: int) -> torch.Tensor:
    """YaRN: high frequencies (many rotations over the original length) kept, low ones divided
    by factor, a linear ramp over the dims between beta_fast and beta_slow rotations."""
    dim, base = head_dim, rope.theta

    def correction_dim(num_rotations: float) -> float:
        # The dim whose wavelength fits num_rotations times into the original length.
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D / 2]
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate fully
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
