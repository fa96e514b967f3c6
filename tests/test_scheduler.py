"""Scheduler and slot allocator alone: no model, no tensors."""

from __future__ import annotations

import pytest

from model_worker.kv_cache import SlotAllocator
from model_worker.scheduler import Scheduler
from model_worker.sequence import SamplingParams, Sequence


def seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id, list(range(prompt_len)), SamplingParams(), max_tokens=10, stop_token_ids=frozenset())


def run_chunks(scheduler: Scheduler) -> list[tuple[int, int, int]]:
    """Schedules one step and pretends the model computed it (sampling one token where due)."""
    out = scheduler.schedule()
    done = []
    for c in out.chunks:
        done.append((c.seq.seq_id, c.start, c.num_tokens))
        c.seq.num_computed_tokens += c.num_tokens
        if c.completes_sequence:
            c.seq.output_token_ids.append(0)
    return done


def test_slot_allocator_reuses_freed_slots_and_refuses_double_free():
    slots = SlotAllocator(2)
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {0, 1} and not slots.can_allocate()
    slots.deallocate(a)
    assert slots.allocate() == a
    with pytest.raises(ValueError):
        slots.deallocate(5)
    slots.deallocate(b)
    with pytest.raises(ValueError):
        slots.deallocate(b)


def test_long_prompt_is_chunked_and_decodes_are_not_stalled():
    scheduler = Scheduler(SlotAllocator(4), max_num_batched_tokens=8)
    short = seq(0, 3)
    scheduler.add(short)
    assert run_chunks(scheduler) == [(0, 0, 3)]
    long = seq(1, 20)
    scheduler.add(long)
    # Every step: the running decode first (1 token), then 7 prompt tokens of the long one.
    assert run_chunks(scheduler) == [(1, 0, 7), (0, 3, 1)]
    assert run_chunks(scheduler) == [(1, 7, 7), (0, 4, 1)]
    assert run_chunks(scheduler) == [(1, 14, 6), (0, 5, 1)]
    assert run_chunks(scheduler) == [(0, 6, 1), (1, 20, 1)]


def test_waiting_requests_wait_for_a_free_slot_in_arrival_order():
    slots = SlotAllocator(2)
    scheduler = Scheduler(slots, max_num_batched_tokens=100)
    seqs = [seq(i, 2) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    assert [c[0] for c in run_chunks(scheduler)] == [0, 1]
    scheduler.finish(seqs[0])
    assert slots.num_free == 1
    assert sorted(c[0] for c in run_chunks(scheduler)) == [1, 2]
    assert [s.seq_id for s in scheduler.waiting] == [3]


def test_finish_of_waiting_sequence_removes_it_without_a_slot():
    slots = SlotAllocator(1)
    scheduler = Scheduler(slots, max_num_batched_tokens=100)
    a, b = seq(0, 2), seq(1, 2)
    scheduler.add(a)
    scheduler.add(b)
    run_chunks(scheduler)
    scheduler.finish(b)
    assert not scheduler.waiting and slots.num_free == 0
    scheduler.finish(a)
    assert slots.num_free == 1 and not scheduler.has_work()
