"""Decides which tokens of which sequences the next engine step computes.

Pure bookkeeping (no tensors): running sequences decode first, then prompts are prefilled in
chunks that fit the step's token budget, so a long prompt never stalls running decodes. KV
room comes from the block manager; when a decode cannot get a block, the newest running
sequence is preempted (its blocks freed, recomputed later from its tokens so far).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from model_worker.block_manager import BlockCopy, BlockManager
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
    # Copy-on-write of shared partial blocks, to run before the forward.
    block_copies: list[BlockCopy] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


def _is_decode(seq: Sequence) -> bool:
    return seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens > 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; preemption takes from the end
        self.num_preemptions = 0
        # id() of the waiting sequences that are requests not yet admitted (added with queued=True):
        # `waiting` also holds preempted sequences of running requests and beam-search rounds.
        self._queued: set[int] = set()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence, queued: bool = True) -> None:
        """queued: seq is a new request, counted by num_queued_beyond_seats until admitted."""
        self.waiting.append(seq)
        if queued:
            self._queued.add(id(seq))

    def num_queued_beyond_seats(self) -> int:
        """New requests waiting that the seats left would not take at once (the waiting room's
        measure): not preempted sequences or a search's rounds, which belong to admitted requests,
        and not the requests of a burst that free seats admit at the next step."""
        free = self.max_num_seqs - sum(1 + seq.num_pending_forks for seq in self.running)
        # Preempted sequences and rounds go first (preemption puts them at the front): a seat for
        # each and for each sample a prompt preempted before its first token will still fork.
        free -= sum(1 + seq.num_pending_forks for seq in self.waiting if id(seq) not in self._queued)
        admitted_next = 0
        if free > 0:  # the new requests, in order, that the free seats take (one per sample of each)
            for seq in self.waiting:
                if id(seq) not in self._queued:
                    continue
                seats = 1 + seq.num_pending_forks
                if seats > free:
                    break
                free -= seats
                admitted_next += 1
        return len(self._queued) - admitted_next

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        blocks = self.block_manager
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        copies: list[BlockCopy] = []
        # Decodes first: every running sequence past its prompt costs one token and, at a
        # block boundary, one block; newer sequences are preempted until it gets one.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not _is_decode(seq):
                i += 1
                continue
            new_copies = blocks.append_slots(seq, 1)
            while new_copies is None:
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
                new_copies = blocks.append_slots(seq, 1)
            if new_copies is None:
                break  # seq preempted itself: it was the newest, so the pass is over
            copies.extend(new_copies)
            decodes.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            budget -= 1
            i += 1
        # Then running sequences whose prompts are partly computed (chunked prefill), as far
        # as free blocks allow: they never preempt, the decodes above already did.
        for seq in self.running:
            if budget <= 0:
                break
            if _is_decode(seq):
                continue
            n = min(seq.num_uncomputed_tokens, budget, blocks.max_new_tokens(seq))
            if n <= 0:
                continue
            copies.extend(blocks.append_slots(seq, n))
            prefills.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        # Then admit waiting sequences in arrival order while blocks, budget and seats remain.
        # A request with n / best_of samples needs a seat for each once its prompt is done, and
        # a running one whose prompt is not done yet still holds the seats of its samples.
        seats_taken = sum(1 + seq.num_pending_forks for seq in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            seats = 1 + seq.num_pending_forks
            if seats_taken and seats_taken + seats > self.max_num_seqs:
                break
            # A preempted sequence (or a sample forked without blocks) gets back blocks that hold
            # its own earlier work: neither its usage nor the prefix cache's hit rate counts them.
            first_admission = not seq.was_admitted and not seq.output_token_ids
            # Prompt logprobs need every prompt position's logits, so no cached prefix for
            # them until the first token is out (a recompute after preemption may use it).
            n = blocks.allocate_prompt(seq, budget, use_prefix_cache=(
                seq.sampling.prompt_logprobs is None or bool(seq.output_token_ids)), count_hits=first_admission)
            if n == 0:
                break
            self.waiting.popleft()
            self._queued.discard(id(seq))
            if first_admission:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.was_admitted = True
            self.running.append(seq)
            seats_taken += seats
            prefills.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(prefills, decodes, copies)

    def update_computed(self, scheduled: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens are cached; full blocks join the prefix cache."""
        for chunk in scheduled.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_full_blocks(chunk.seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child (same tokens as parent) starts running on parent's blocks, shared (or on blocks
        of its own where caches are per sequence); with too few free for that, it waits as a
        preempted sequence does and recomputes its tokens once admitted."""
        if self.block_manager.fork(parent, child):
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            self.waiting.appendleft(child)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: its full blocks stay in the prefix cache, so re-admission
        # often gets most of them back without a forward.
        self.block_manager.deallocate(seq)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drops a finished or aborted sequence and frees its blocks at once."""
        self.block_manager.deallocate(seq)
        self._queued.discard(id(seq))
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
