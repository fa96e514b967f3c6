"""How one engine step's flattened tokens split into per-sequence attention segments.

Built by the model runner from the scheduler's output; read by every attention layer, so it
is computed once per step, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSegment:
    """n query tokens of one sequence at rows [start, start+n), attending to its first
    context_len + n cached positions (context_len tokens were cached by earlier steps)."""

    start: int
    num_tokens: int
    slot: int
    context_len: int
    # [n, context_len + n] bool, True where attention is allowed; None when context_len is
    # 0, then SDPA's is_causal does the same without building a mask.
    mask: torch.Tensor | None


@dataclass
class DecodeBatch:
    """One query token per sequence at rows [start, start+B); sequence b attends to its
    first seq_lens[b] cached positions (the new token included)."""

    start: int
    slots: torch.Tensor  # [B] long
    max_len: int
    mask: torch.Tensor  # [B, 1, 1, max_len] bool, True where position < seq_len


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] long, position of every flattened token
    slot_of_token: torch.Tensor  # [T] long, KV cache slot every token writes to
    prefills: list[PrefillSegment]
    decode: DecodeBatch | None

    @classmethod
    def build(cls, prefills: list[tuple[int, int, int]], decodes: list[tuple[int, int]],
              device: torch.device) -> AttentionMetadata:
        """prefills: (slot, context_len, num_tokens) per chunk; decodes: (slot, context_len)
        per one-token sequence. Rows are laid out prefills first, then decodes."""
        positions: list[int] = []
        slots: list[int] = []
        segments: list[PrefillSegment] = []
        row = 0
        for slot, context_len, n in prefills:
            positions.extend(range(context_len, context_len + n))
            slots.extend([slot] * n)
            mask = None
            if context_len > 0:
                key_pos = torch.arange(context_len + n, device=device)
                query_pos = torch.arange(context_len, context_len + n, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
            segments.append(PrefillSegment(row, n, slot, context_len, mask))
            row += n
        decode = None
        if decodes:
            positions.extend(context_len for _, context_len in decodes)
            slots.extend(slot for slot, _ in decodes)
            seq_lens = torch.tensor([context_len + 1 for _, context_len in decodes], device=device)
            max_len = int(seq_lens.max())
            mask = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
            decode = DecodeBatch(
                start=row,
                slots=torch.tensor([slot for slot, _ in decodes], device=device),
                max_len=max_len,
                mask=mask[:, None, None, :],
            )
        return cls(
            positions=torch.tensor(positions, device=device),
            slot_of_token=torch.tensor(slots, device=device),
            prefills=segments,
            decode=decode,
        )
