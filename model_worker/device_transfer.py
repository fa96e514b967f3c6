"""Host data onto the model's device without waiting for the device.

A plain `torch.tensor(data, device="cuda")` (or `cpu_tensor.to("cuda")`) copies from pageable
memory, and CUDA syncs the stream before such a copy: queued on a busy stream, the host would
wait for every kernel already launched (the forward, when the sampler builds its batch). Staged in
pinned memory the copy is queued like a kernel instead, and the host goes on; torch's pinned-memory
allocator keeps the staging block until the copy has run. On the CPU these are plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch


def tensor_on(device: torch.device, data: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(data, dtype) on `device`, queued without a host sync on CUDA."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def moved_to(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A CPU tensor on `device`, queued without a host sync on CUDA."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
