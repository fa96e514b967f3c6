"""Scheduler and block manager alone: no model, no tensors."""

from __future__ import annotations

from model_worker.block_manager import BlockManager
from model_worker.scheduler import Scheduler
from model_worker.sequence import SamplingParams, Sequence


def seq(seq_id: int, prompt_len: int, first_token: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(first_token, first_token + prompt_len)), SamplingParams(), max_tokens=10,
                    stop_token_ids=frozenset())


def run_chunks(scheduler: Scheduler) -> list[tuple[int, int, int]]:
    """Schedules one step and pretends the model computed it (sampling one token where due)."""
    out = scheduler.schedule()
    scheduler.update_computed(out)
    done = []
    for c in out.chunks:
        done.append((c.seq.seq_id, c.start, c.num_tokens))
        if c.completes_sequence:
            c.seq.output_token_ids.append(1000 + c.seq.seq_id)
    return done


def test_long_prompt_is_chunked_and_decodes_are_not_stalled():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    short = seq(0, 3)
    scheduler.add(short)
    assert run_chunks(scheduler) == [(0, 0, 3)]
    long = seq(1, 20, first_token=100)
    scheduler.add(long)
    # Every step: the running decode first (1 token), then 7 prompt tokens of the long one.
    assert run_chunks(scheduler) == [(1, 0, 7), (0, 3, 1)]
    assert run_chunks(scheduler) == [(1, 7, 7), (0, 4, 1)]
    assert run_chunks(scheduler) == [(1, 14, 6), (0, 5, 1)]
    assert run_chunks(scheduler) == [(0, 6, 1), (1, 20, 1)]


def test_waiting_requests_wait_for_a_seat_in_arrival_order():
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(i, 2, first_token=10 * i) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    assert [c[0] for c in run_chunks(scheduler)] == [0, 1]
    scheduler.finish(seqs[0])
    assert sorted(c[0] for c in run_chunks(scheduler)) == [1, 2]
    assert [s.seq_id for s in scheduler.waiting] == [3]


def test_admission_waits_for_blocks_and_finish_frees_them():
    bm = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq(0, 8), seq(1, 8, first_token=50)
    scheduler.add(a)
    scheduler.add(b)
    assert run_chunks(scheduler) == [(0, 0, 8)]  # b's 2 blocks are not there
    assert list(scheduler.waiting) == [b] and bm.num_used_blocks == 2
    scheduler.finish(a)
    assert bm.num_used_blocks == 0
    assert run_chunks(scheduler) == [(1, 0, 8)]
    scheduler.finish(b)
    assert not scheduler.has_work() and bm.num_used_blocks == 0


def test_prefix_cache_hit_skips_the_cached_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = seq(0, 10)
    scheduler.add(a)
    run_chunks(scheduler)
    b = Sequence(1, list(range(8)) + [77, 78], SamplingParams(), max_tokens=10, stop_token_ids=frozenset())
    scheduler.add(b)
    assert (1, 8, 2) in run_chunks(scheduler)
    assert b.num_cached_prompt_tokens == 8


def test_a_prompt_preempted_mid_prefill_counts_no_cache_hits_of_its_own_blocks():
    """Re-admitted after a preemption, a prompt gets back the full blocks it computed itself:
    neither its usage's cached tokens nor the prefix cache's hit counters take them."""
    bm = BlockManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    short = seq(0, 3, first_token=100)
    scheduler.add(short)
    run_chunks(scheduler)
    long = seq(1, 20, first_token=200)  # chunked 7-8 tokens a step; nothing shares its prompt
    scheduler.add(long)
    for _ in range(12):
        run_chunks(scheduler)
        if len(short.output_token_ids) >= 10 and short in scheduler.running:
            scheduler.finish(short)
        if long.output_token_ids:
            break
    assert scheduler.num_preemptions >= 1 and long.output_token_ids
    assert long.num_cached_prompt_tokens == 0
    assert bm.prefix_hit_tokens == 0 and bm.prefix_queried_tokens == 3 + 20


def test_decode_without_a_block_preempts_the_newest_which_recomputes_later():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = seq(0, 4), seq(1, 4, first_token=50)
    scheduler.add(old)
    scheduler.add(new)
    assert run_chunks(scheduler) == [(0, 0, 4), (1, 0, 4)]  # all 4 blocks used
    # Both decodes need a third block: the newest is preempted so the oldest can go on.
    assert run_chunks(scheduler) == [(0, 4, 1)]
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [new]
    assert new.num_computed_tokens == 0 and new.output_token_ids == [1001] and new.block_table == []
    scheduler.finish(old)
    # Recompute: the prompt and the token sampled so far, as one prefill.
    assert run_chunks(scheduler) == [(1, 0, 5)]
    assert new.output_token_ids == [1001, 1001]


def test_fork_shares_the_prompt_and_each_sample_decodes():
    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    parent = seq(0, 6)
    scheduler.add(parent)
    run_chunks(scheduler)
    child = Sequence(1, parent.prompt_token_ids, SamplingParams(), max_tokens=10, stop_token_ids=frozenset(),
                     output_token_ids=[5], sample_index=1)
    scheduler.fork(parent, child)
    used = bm.num_used_blocks
    out = scheduler.schedule()
    assert [(c.seq.seq_id, c.start) for c in out.decodes] == [(0, 6), (1, 6)]
    # The shared partial block is copied once (for the first writer); the other writes in place.
    assert len(out.block_copies) == 1 and bm.num_used_blocks == used + 1


def check_block_invariants(scheduler: Scheduler) -> None:
    """Every block's ref count equals the tables holding it; free + used == total."""
    bm = scheduler.block_manager
    holders: dict[int, int] = {}
    for s in scheduler.running:
        for b in s.block_table:
            holders[b] = holders.get(b, 0) + 1
        # A running sequence has blocks for every computed token.
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
    assert all(not s.block_table for s in scheduler.waiting)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert bm.num_used_blocks == len(holders)


def test_a_running_prompt_keeps_seats_for_the_samples_it_will_fork():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=100)
    three_samples = Sequence(0, [1, 2], SamplingParams(), max_tokens=5, stop_token_ids=frozenset(),
                             num_pending_forks=2)
    scheduler.add(three_samples)
    for i in (1, 2, 3):
        scheduler.add(seq(i, 2, first_token=10 * i))
    # Its 3 seats and one more fit in 4; the other two wait although only 2 sequences run yet.
    assert [s for s, _, _ in run_chunks(scheduler)] == [0, 1]
    assert len(scheduler.waiting) == 2
    # A request bigger than max_num_seqs alone still runs when nothing else does.
    alone = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    alone.add(Sequence(9, [1, 2], SamplingParams(), max_tokens=5, stop_token_ids=frozenset(), num_pending_forks=3))
    assert [s for s, _, _ in run_chunks(alone)] == [9]


def test_random_load_with_forks_preemption_and_aborts_keeps_the_books_straight():
    import random

    rng = random.Random(1234)
    bm = BlockManager(num_blocks=12, block_size=4)  # any one sequence fits in 10
    scheduler = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=10)
    next_id = 0
    done = 0
    for _ in range(400):
        if rng.random() < 0.5:
            prefix = [7] * rng.choice([0, 4, 8])  # shared prefixes give prefix-cache hits
            s = Sequence(next_id, prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 12))],
                         SamplingParams(), max_tokens=rng.randint(1, 20), stop_token_ids=frozenset(),
                         num_pending_forks=rng.choice([0, 0, 1, 2]))
            next_id += 1
            scheduler.add(s)
        out = scheduler.schedule()
        check_block_invariants(scheduler)
        scheduler.update_computed(out)
        for c in out.chunks:
            if not c.completes_sequence:
                continue
            c.seq.output_token_ids.append(rng.randrange(1000))
            for _ in range(c.seq.num_pending_forks):
                child = Sequence(next_id, c.seq.prompt_token_ids, SamplingParams(), max_tokens=c.seq.max_tokens,
                                 stop_token_ids=frozenset(), output_token_ids=[rng.randrange(1000)])
                next_id += 1
                scheduler.fork(c.seq, child)
            c.seq.num_pending_forks = 0
        assert len(scheduler.running) <= scheduler.max_num_seqs  # samples forked included
        for s in list(scheduler.running):
            if len(s.output_token_ids) >= s.max_tokens or (s.output_token_ids and rng.random() < 0.02):
                scheduler.finish(s)
                done += 1
        check_block_invariants(scheduler)
    while scheduler.has_work():
        for s in list(scheduler.running) + list(scheduler.waiting):
            scheduler.finish(s)
    assert done > 50 and scheduler.num_preemptions > 0 and bm.prefix_hit_tokens > 0
    assert bm.num_used_blocks == 0


def test_a_preempted_prompt_keeps_the_seats_of_the_samples_it_will_fork_in_the_waiting_count():
    """A prompt preempted before its first token still forks its n - 1 samples once re-admitted:
    the waiting room's count gives them seats, so a new request behind it is beyond the seats."""
    scheduler = Scheduler(BlockManager(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    preempted = seq(0, 6)
    preempted.num_pending_forks = 3  # n=4: all four seats once it is back
    scheduler.add(preempted, queued=False)  # as _preempt puts it back: not a new request
    scheduler.add(seq(1, 3, first_token=50))
    assert scheduler.num_queued_beyond_seats() == 1
    preempted.num_pending_forks = 2  # n=3: one seat is left for the new request
    assert scheduler.num_queued_beyond_seats() == 0
