"""The KV cache: one fixed slot of max_model_len positions per running sequence.

SlotAllocator is the pure bookkeeping the scheduler asks for room; KVCache holds the
tensors the model writes. A slot is returned the moment its request finishes or aborts.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """Hands out slot indices 0..num_slots-1; no tensors, so the scheduler is testable alone."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Lowest slot first keeps the touched cache memory compact at low load.
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        return self._free.pop()

    def deallocate(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)


class KVCache:
    """key[layer], value[layer]: [num_slots, num_kv_heads, max_model_len, head_dim]."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_model_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_model_len, head_dim)
        # zeros, not empty: masked-out positions are multiplied by zero attention weight,
        # and NaN garbage from uninitialised memory would turn 0 * NaN into NaN.
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:
        """key/value [T, Hkv, D] go to (slots[t], :, positions[t], :)."""
        self.key[layer, slots, :, positions] = key
        self.value[layer, slots, :, positions] = value
