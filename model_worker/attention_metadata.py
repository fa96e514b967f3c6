"""How one engine step's flattened tokens split into per-sequence attention segments, and
where in the paged KV cache every token's keys and values live.

Built by the model runner from the scheduler's output and the sequences' block tables; read
by every attention layer, so it is computed once per step, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_worker.device_transfer import tensor_on


@dataclass
class PrefillSegment:
    """n query tokens of one sequence at rows [start, start+n), attending to its first
    context_len + n positions (context_len of them cached by earlier steps)."""

    start: int
    num_tokens: int
    context_len: int
    # [ceil((context_len + n) / block_size)] long: blocks holding those positions; None when
    # context_len is 0, then attention reads the step's own keys and values, no gather.
    block_ids: torch.Tensor | None
    # [n, context_len + n] bool, True where attention is allowed; None when context_len is
    # 0, then SDPA's is_causal does the same without building a mask.
    mask: torch.Tensor | None
    # [n, context_len + n] bool, the causal mask cut to the sliding window (key k allowed for
    # the query at p when p - window < k <= p), for sliding-window layers; None when the window
    # excludes no key of this chunk, then `mask` (or is_causal) is already the same.
    window_mask: torch.Tensor | None = None


@dataclass
class DecodeBatch:
    """One query token per sequence at rows [start, start+B); sequence b attends to its
    first seq_lens[b] cached positions (the new token included)."""

    start: int
    block_tables: torch.Tensor  # [B, max_blocks] long, short rows padded with block 0 (masked)
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool, True where position < seq_len
    seq_lens: torch.Tensor  # [B] long, each sequence's seq_len (what a compiled kernel reads instead of mask)
    # [B, 1, 1, max_blocks * block_size] bool, also False before seq_len - window, for
    # sliding-window layers; None when no sequence is longer than the window.
    window_mask: torch.Tensor | None = None

    @classmethod
    def masked(cls, start: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, key_positions: torch.Tensor,
               sliding_window: int = 0) -> DecodeBatch:
        """The batch with its masks computed on the device from seq_lens [B] and key_positions
        [max_blocks * block_size] (0..L-1); a window mask when sliding_window > 0."""
        mask = key_positions[None, :] < seq_lens[:, None]  # [B, L]
        window_mask = None
        if sliding_window > 0:
            window_mask = (mask & (key_positions[None, :] >= seq_lens[:, None] - sliding_window))[:, None, None, :]
        return cls(start, block_tables, mask[:, None, None, :], seq_lens, window_mask)


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] long, position of every flattened token
    slot_mapping: torch.Tensor  # [T] long, flat cache slot (block * block_size + offset) of every token
    prefills: list[PrefillSegment]
    decode: DecodeBatch | None
    sliding_window: int = 0  # the model's window in tokens (0: none), for the window masks

    @classmethod
    def build(cls, prefills: list[tuple[list[int], int, int]], decodes: list[tuple[list[int], int]],
              block_size: int, device: torch.device, sliding_window: int = 0) -> AttentionMetadata:
        """prefills: (block_table, context_len, num_tokens) per chunk; decodes: (block_table,
        context_len) per one-token sequence. Rows are laid out prefills first, then decodes.
        sliding_window > 0 also builds window masks wherever the window excludes a key."""
        positions: list[int] = []
        slots: list[int] = []
        segments: list[PrefillSegment] = []
        row = 0
        for table, context_len, n in prefills:
            end = context_len + n
            positions.extend(range(context_len, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(context_len, end))
            block_ids = mask = window_mask = None
            windowed = 0 < sliding_window < end  # the last query (at end - 1) cannot see key 0
            if context_len > 0 or windowed:
                key_pos = torch.arange(end, device=device)[None, :]
                query_pos = torch.arange(context_len, end, device=device)[:, None]
                causal = key_pos <= query_pos  # [n, end]
                if context_len > 0:
                    block_ids = tensor_on(device, table[:-(-end // block_size)], torch.long)
                    mask = causal
                if windowed:
                    window_mask = causal & (key_pos > query_pos - sliding_window)
            segments.append(PrefillSegment(row, n, context_len, block_ids, mask, window_mask))
            row += n
        decode = None
        if decodes:
            max_blocks = max(context_len // block_size + 1 for _, context_len in decodes)
            rows = []
            for table, context_len in decodes:
                positions.append(context_len)
                slots.append(table[context_len // block_size] * block_size + context_len % block_size)
                used = table[:context_len // block_size + 1]
                rows.append(used + [0] * (max_blocks - len(used)))
            seq_lens = tensor_on(device, [context_len + 1 for _, context_len in decodes], torch.long)
            windowed = 0 < sliding_window < max(context_len + 1 for _, context_len in decodes)
            decode = DecodeBatch.masked(row, tensor_on(device, rows, torch.long), seq_lens,
                                        torch.arange(max_blocks * block_size, device=device),
                                        sliding_window if windowed else 0)
        return cls(
            positions=tensor_on(device, positions, torch.long),
            slot_mapping=tensor_on(device, slots, torch.long),
            prefills=segments,
            decode=decode,
            sliding_window=sliding_window,
        )
