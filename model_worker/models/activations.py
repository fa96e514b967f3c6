"""The MLP activations of config.json's hidden_act / activation_function, as transformers'
ACT2FN computes them (the native models refuse any other name)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# gelu_new and gelu_fast are transformers' spellings of GELU's tanh approximation (GPT-2's).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
