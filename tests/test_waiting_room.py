"""--max-waiting-requests counts new requests that the free seats will not take at the next step:
not a burst that free seats admit, not a running request's preempted samples (review findings)."""

from __future__ import annotations

import grpc
import pytest
import torch

from model_worker.engine import LLMEngine, RequestRejected
from model_worker.model_runner import ModelRunner
from model_worker.sequence import SamplingParams


def make_engine(tiny_model_dir, max_num_seqs: int, max_waiting: int, kv_cache_tokens: int = 1024) -> LLMEngine:
    runner = ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), torch.float32, max_num_seqs, 64,
                         kv_cache_tokens=kv_cache_tokens, block_size=4)
    return LLMEngine(runner, eos_token_ids=[], max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                     max_waiting_requests=max_waiting)


def add(engine: LLMEngine, seq_id: int, **kwargs) -> None:
    engine.add_request(seq_id, [5, 6, 7], kwargs.pop("sampling", SamplingParams()), kwargs.pop("max_tokens", 4), [],
                       True, **kwargs)


def test_a_burst_fills_the_free_seats_before_the_waiting_room(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_waiting=4)
    for seq_id in range(8):  # 4 take the seats at the next step, 4 wait
        add(engine, seq_id)
    with pytest.raises(RequestRejected, match="4 requests are already waiting") as info:
        add(engine, 8)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    engine.step()  # 4 run now; the other 4 still wait
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 4
    with pytest.raises(RequestRejected, match="4 requests are already waiting"):
        add(engine, 8)
    # A request with n samples holds a seat for each, queued or running: 2 + 2 of them fill 4 seats.
    other = make_engine(tiny_model_dir, max_num_seqs=4, max_waiting=1)
    add(other, 0, n=2)
    other.step()
    add(other, 1, n=2)
    other.step()
    add(other, 2)
    with pytest.raises(RequestRejected, match="1 requests are already waiting"):
        add(other, 3)


def test_preempted_samples_of_a_running_request_take_no_waiting_room(tiny_model_dir):
    # 16 blocks of 4 tokens: 4 samples of a 9-token prompt growing to 30 tokens need 32, so some are
    # preempted back to the waiting queue while the request runs.
    engine = make_engine(tiny_model_dir, max_num_seqs=8, max_waiting=2, kv_cache_tokens=64)
    add(engine, 0, sampling=SamplingParams(temperature=1.0, seed=1), max_tokens=21, n=4)
    for _ in range(60):
        engine.step()
        if len(engine.scheduler.waiting) >= 2:
            break
    assert len(engine.scheduler.waiting) >= 2 and list(engine.groups) == [0]
    add(engine, 1)  # refused before: "2 requests are already waiting"
    add(engine, 2)
    while engine.has_work():
        engine.step()
    assert not engine.groups and engine.block_manager.num_used_blocks == 0


def test_a_queued_request_with_n_samples_takes_a_seat_for_each(tiny_model_dir):
    # Review finding: four n=4 requests fit 4 seats once each, not four times.
    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_waiting=1)
    add(engine, 0, n=4)  # its 4 samples take the 4 seats at the next step
    add(engine, 1, n=4)  # waits
    with pytest.raises(RequestRejected, match="1 requests are already waiting"):
        add(engine, 2, n=4)


def test_a_beam_search_waits_as_one_request(tiny_model_dir):
    """Review finding: a search's rounds are added as admitted, so searches never counted in the
    waiting room (40 were taken with room for 1); its first round's request now counts for it."""
    from model_worker.beam_search_request import BeamSearchRequest

    engine = make_engine(tiny_model_dir, max_num_seqs=2, max_waiting=1)
    ids = iter(range(1000, 10**6))

    def search(seq_id: int) -> BeamSearchRequest:
        request = BeamSearchRequest(engine, lambda: next(ids), seq_id, [5, 6, 7], SamplingParams(), 3, [], True, 1,
                                    2, 1.0, 0.0)
        request.start()
        return request

    search(1)
    search(2)  # the 2 seats take the first two searches' first rounds
    search(3)  # waits
    with pytest.raises(RequestRejected, match="1 requests are already waiting"):
        search(4)
    with pytest.raises(RequestRejected, match="1 requests are already waiting"):
        add(engine, 5)  # a plain request sees the same room
