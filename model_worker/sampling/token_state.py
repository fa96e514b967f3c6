"""Per-row token statistics the penalties read, kept on the device and updated incrementally.

Built for a batch's rows when the batch changes (rows that stay are copied from the previous
batch, new rows are counted from their token lists once); each step then adds only the new token
(scatter_add), so no [S, V] tensor is rebuilt from token lists per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_worker.device_transfer import moved_to, tensor_on
from model_worker.sequence import Sequence


@dataclass(frozen=True)
class StateNeeds:
    """Which statistics the batch's parameters read; the others are not allocated."""

    output_counts: bool = False  # presence / frequency
    seen: bool = False  # HF repetition_penalty
    window_counts: bool = False  # llama.cpp repeat_penalty
    history: bool = False  # DRY, and window_counts' tokens leaving the window


@dataclass
class TokenState:
    num_output: torch.Tensor  # [S] long, output tokens so far (also the draw's position)
    num_tokens: torch.Tensor  # [S] long, prompt + output
    output_counts: torch.Tensor | None  # [S, V] float32 (exact to 2**24), read as is by the penalty
    seen: torch.Tensor | None  # [S, V] bool, token in prompt or output
    window_counts: torch.Tensor | None  # [S, V] int32, counts over the last window_n tokens
    window_n: torch.Tensor | None  # [S] long; <= 0: the whole context (nothing leaves)
    history: torch.Tensor | None  # [S, capacity] long, prompt + output, left-aligned, -1 padded
    max_num_tokens: int  # host copy of num_tokens.max(), to grow history without a sync

    @classmethod
    def build(cls, seqs: list[Sequence], needs: StateNeeds, window_n: list[int], vocab_size: int,
              device: torch.device, previous: TokenState | None, reuse: list[int | None]) -> TokenState:
        """reuse[i]: the row of previous holding seqs[i]'s current statistics, or None."""
        num_tokens = [s.num_tokens for s in seqs]
        state = cls(
            num_output=tensor_on(device, [len(s.output_token_ids) for s in seqs], torch.long),
            num_tokens=tensor_on(device, num_tokens, torch.long),
            output_counts=None, seen=None, window_counts=None,
            window_n=tensor_on(device, window_n, torch.long) if needs.window_counts else None,
            history=None, max_num_tokens=max(num_tokens),
        )
        if needs.history:
            capacity = max(64, 1 << (state.max_num_tokens + 1).bit_length())
            state.history = _fill(previous and previous.history, reuse, seqs, capacity, torch.long, -1,
                                  lambda fresh: _history(fresh, capacity, device))
        if needs.output_counts:
            state.output_counts = _fill(previous and previous.output_counts, reuse, seqs, vocab_size, torch.float32, 0,
                                        lambda fresh: _counts([s.output_token_ids for s in fresh], vocab_size, device))
        if needs.seen:
            state.seen = _fill(previous and previous.seen, reuse, seqs, vocab_size, torch.bool, False,
                               lambda fresh: _counts([s.prompt_token_ids + s.output_token_ids for s in fresh],
                                                     vocab_size, device) > 0)
        if needs.window_counts:
            # A reused row counted over its own window_n, which a sequence keeps for life.
            last_n = {id(s): n for s, n in zip(seqs, window_n, strict=True)}

            def window_tokens(s: Sequence) -> list[int]:
                tokens = s.prompt_token_ids + s.output_token_ids
                return tokens[-last_n[id(s)]:] if last_n[id(s)] > 0 else tokens

            state.window_counts = _fill(previous and previous.window_counts, reuse, seqs, vocab_size, torch.int32, 0,
                                        lambda fresh: _counts([window_tokens(s) for s in fresh], vocab_size, device))
        return state

    def append(self, token_ids: torch.Tensor) -> None:
        """token_ids [S] long: every row's new token (all on the device, no host sync)."""
        column = token_ids[:, None]  # [S, 1]
        if self.output_counts is not None:
            self.output_counts.scatter_add_(1, column, torch.ones_like(column, dtype=torch.float32))
        if self.seen is not None:
            self.seen.scatter_(1, column, True)
        if self.window_counts is not None:
            self.window_counts.scatter_add_(1, column, torch.ones_like(column, dtype=torch.int32))
            if self.history is not None:
                # The window [L-N, L) becomes [L-N+1, L+1): position L-N leaves.
                leave = self.num_tokens - self.window_n  # [S]
                leaving = (self.window_n > 0) & (leave >= 0)
                # Rows without a window (window_n -1) have leave = L + 1, past what history holds.
                leave_ids = self.history.gather(1, torch.where(leaving, leave, 0)[:, None])
                self.window_counts.scatter_add_(1, leave_ids.clamp(min=0), -leaving[:, None].to(torch.int32))
        if self.history is not None:
            if self.max_num_tokens + 1 > self.history.shape[1]:
                grown = torch.full((self.history.shape[0], 2 * self.history.shape[1]), -1, dtype=torch.long,
                                   device=self.history.device)
                grown[:, :self.history.shape[1]] = self.history
                self.history = grown
            self.history.scatter_(1, self.num_tokens[:, None], column)
        self.num_tokens += 1
        self.num_output += 1
        self.max_num_tokens += 1

    def windows(self, rows: torch.Tensor, last_n: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last tokens of some rows: rows [R], last_n [R] (<= 0: everything) ->
        (tokens [R, width] right-aligned, -1 padded; valid [R, width] bool)."""
        num_tokens = self.num_tokens.index_select(0, rows)
        offsets = torch.arange(width, device=rows.device) - width  # [-width, 0)
        positions = num_tokens[:, None] + offsets[None, :]
        span = torch.where(last_n > 0, torch.minimum(last_n, num_tokens), num_tokens)
        valid = (positions >= 0) & (offsets[None, :] >= -span[:, None])
        tokens = self.history.index_select(0, rows).gather(1, positions.clamp(min=0))
        return torch.where(valid, tokens, -1), valid


def _fill(previous: torch.Tensor | None, reuse: list[int | None], seqs: list[Sequence], width: int,
          dtype: torch.dtype, pad: int | bool,
          build_fresh: Callable[[list[Sequence]], torch.Tensor]) -> torch.Tensor:
    """[S, width]: rows found in `previous` are copied from it on the device; the others come from
    build_fresh(their sequences), counted once from their token lists."""
    device = previous.device if previous is not None else None
    kept = [(i, r) for i, r in enumerate(reuse) if r is not None] if previous is not None else []
    fresh = [i for i, r in enumerate(reuse) if previous is None or r is None]
    fresh_rows = build_fresh([seqs[i] for i in fresh]) if fresh else None
    device = device or fresh_rows.device
    out = torch.full((len(seqs), width), pad, dtype=dtype, device=device)
    if kept:
        src = tensor_on(device, [r for _, r in kept], torch.long)
        dst = tensor_on(device, [i for i, _ in kept], torch.long)
        copy_width = min(width, previous.shape[1])
        out[:, :copy_width] = out[:, :copy_width].index_copy(0, dst, previous.index_select(0, src)[:, :copy_width])
    if fresh:
        out.index_copy_(0, tensor_on(device, fresh, torch.long), fresh_rows.to(dtype))
    return out


def _counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] int32 occurrence counts, one scatter for all rows."""
    rows = tensor_on(device, [r for r, tokens in enumerate(token_lists) for _ in tokens], torch.long)
    ids = tensor_on(device, [t for tokens in token_lists for t in tokens], torch.long)
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.int32, device=device)
    counts.index_put_((rows, ids), torch.ones(len(ids), dtype=torch.int32, device=device), accumulate=True)
    return counts


def _history(seqs: list[Sequence], capacity: int, device: torch.device) -> torch.Tensor:
    """[R, capacity] long: each row's prompt + output tokens, left-aligned, -1 padded."""
    history = torch.full((len(seqs), capacity), -1, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens = s.prompt_token_ids + s.output_token_ids
        history[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return moved_to(device, history)
