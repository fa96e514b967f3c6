"""Decides which tokens of which sequences the next engine step computes.

Pure bookkeeping (no tensors): running sequences decode first, then prompts are prefilled in
chunks that fit the step's token budget, so a long prompt never stalls running decodes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from model_worker.kv_cache import SlotAllocator
from model_worker.sequence import Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed this step (== seq.num_computed_tokens)
    num_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every known token is cached, so the step samples a new one."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    # Prefill chunks first, decodes (one token each) last: the model runner lays out rows
    # in this order so all decodes share one batched attention call.
    prefills: list[ScheduledChunk]
    decodes: list[ScheduledChunk]

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, slots: SlotAllocator, max_num_batched_tokens: int) -> None:
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        # Decodes first: every running sequence past its prompt costs one token.
        for seq in self.running:
            if seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens > 0 and budget > 0:
                decodes.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
                budget -= 1
        # Then running sequences whose prompts are partly cached (chunked prefill).
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens > 1 or seq.num_computed_tokens == 0:
                n = min(seq.num_uncomputed_tokens, budget)
                prefills.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
        # Then admit waiting sequences while a slot and budget remain, in arrival order.
        while self.waiting and budget > 0 and self.slots.can_allocate():
            seq = self.waiting.popleft()
            seq.slot = self.slots.allocate()
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            prefills.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(prefills, decodes)

    def finish(self, seq: Sequence) -> None:
        """Drops a finished or aborted sequence and frees its slot at once."""
        if seq.slot >= 0:
            self.slots.deallocate(seq.slot)
            seq.slot = -1
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
