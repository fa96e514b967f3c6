"""Unit tests of RequestState: model-worker tokens and detok text deltas in, GenerationEvents out.

Feeds real proto messages (SequenceTokens, TextDelta) as the two readers would.
"""

from __future__ import annotations

import pytest

from gateway.request_state import RequestState, prompt_logprobs_of
from tokenwire.packing import pack_float32, pack_int32
from tokenwire.v1 import detok_worker_pb2, model_worker_pb2

RUNNING = model_worker_pb2.FINISH_REASON_UNSPECIFIED


def tokens(ids: list[int], finish: int = RUNNING, logprobs: list[float] | None = None,
           top: list[list[tuple[int, float]]] | None = None) -> model_worker_pb2.SequenceTokens:
    seq = model_worker_pb2.SequenceTokens(request_id="r", token_ids=pack_int32(ids), finish_reason=finish,
                                          num_prompt_tokens=4, num_output_tokens=len(ids))
    if logprobs is not None:
        seq.logprobs = pack_float32(logprobs)
    if top:
        seq.num_top_logprobs = len(top[0])
        seq.top_token_ids = pack_int32([t for row in top for t, _ in row])
        seq.top_logprobs = pack_float32([lp for row in top for _, lp in row])
    return seq


def delta(text: str, finished: bool = False, stop_index: int = -1, num_tokens_to_stop: int = 0
          ) -> detok_worker_pb2.TextDelta:
    return detok_worker_pb2.TextDelta(sequence_id="r", text=text, finished=finished, stop_index=stop_index,
                                      num_tokens_to_stop=num_tokens_to_stop)


def test_tokens_ride_with_the_next_text() -> None:
    state = RequestState("r", 4)
    state.record_tokens(tokens([10, 11]))
    event = state.take_event(delta("ab"))
    assert event.text == "ab" and event.token_ids == [10, 11] and event.finish_reason is None
    assert event.num_output_tokens == 2 and event.num_prompt_tokens == 4
    state.record_tokens(tokens([12]))
    assert state.take_event(delta("c")).token_ids == [12]


def test_the_running_count_is_of_tokens_given_out_not_of_tokens_arrived() -> None:
    """Model worker frames can run ahead of the detok worker's replies: an event's count
    (continuous usage stats) is what the client has so far."""
    state = RequestState("r", 4)
    for ids in ([10], [11, 12], [13, 14]):
        state.record_tokens(tokens(ids))
    counts = []
    for text, num_tokens in (("a", 1), ("bc", 2), ("de", 2)):
        reply = delta(text)
        reply.num_tokens = num_tokens
        event = state.take_event(reply)
        counts.append((len(event.token_ids), event.num_output_tokens))
    assert counts == [(1, 1), (2, 3), (2, 5)]
    state.record_tokens(tokens([15], finish=model_worker_pb2.FINISH_REASON_LENGTH))
    last = delta("f", finished=True)
    last.num_tokens = 1
    assert state.take_event(last).num_output_tokens == 6


@pytest.mark.parametrize(("model_finish", "expected"), [
    (model_worker_pb2.FINISH_REASON_STOP, "stop"), (model_worker_pb2.FINISH_REASON_LENGTH, "length"),
])
def test_finish_reason_comes_from_the_model_worker(model_finish: int, expected: str) -> None:
    state = RequestState("r", 4)
    state.record_tokens(tokens([10, 11], finish=model_finish))
    assert state.model_finished
    event = state.take_event(delta("end", finished=True))
    assert event.finish_reason == expected and event.token_ids == [10, 11] and state.finished


def test_stop_string_drops_tokens_past_it() -> None:
    state = RequestState("r", 4)
    state.record_tokens(tokens([1, 2, 3, 4, 5], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5]))
    event = state.take_event(delta("text", finished=True, stop_index=0, num_tokens_to_stop=3))
    assert event.finish_reason == "stop" and not state.model_finished
    assert event.token_ids == [1, 2, 3] and event.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert event.num_output_tokens == 3


def test_stop_string_after_tokens_were_already_sent_counts_only_up_to_it() -> None:
    state = RequestState("r", 4)
    state.record_tokens(tokens([1, 2, 3, 4]))
    assert state.take_event(delta("abcd")).token_ids == [1, 2, 3, 4]
    event = state.take_event(delta("", finished=True, stop_index=0, num_tokens_to_stop=2))
    assert event.token_ids == [] and event.num_output_tokens == 2


def test_top_logprobs_unpack_row_major() -> None:
    state = RequestState("r", 4)
    top = [[(7, -0.5), (8, -1.5)], [(9, -0.25), (7, -2.0)]]
    state.record_tokens(tokens([7, 9], logprobs=[-0.5, -0.25], top=top))
    event = state.take_event(delta("xy"))
    assert event.top_logprobs == [[(7, -0.5), (8, -1.5)], [(9, -0.25), (7, -2.0)]]


def test_minus_infinity_goes_out_as_vllms_minus_9999() -> None:
    # A token the grammar ruled out has -inf, which JSON cannot carry; the first prompt token's
    # NaN (no logprob) stays None.
    inf = float("-inf")
    state = RequestState("r", 4)
    state.record_tokens(tokens([7], logprobs=[-0.5], top=[[(7, -0.5), (8, inf)]]))
    assert state.take_event(delta("x")).top_logprobs == [[(7, -0.5), (8, -9999.0)]]
    seq = tokens([10])
    seq.prompt_logprobs = pack_float32([float("nan"), inf])
    seq.num_prompt_top_logprobs = 1
    seq.prompt_top_token_ids = pack_int32([-1, 7])
    seq.prompt_top_logprobs = pack_float32([float("nan"), inf])
    prompt = prompt_logprobs_of(seq)
    assert (prompt.logprobs, prompt.top_logprobs) == ([None, -9999.0], [[], [(7, -9999.0)]])


def test_num_tokens_attaches_only_the_tokens_a_delta_covers() -> None:
    state = RequestState("r", 4)
    state.record_tokens(tokens([1, 2, 3]))
    # The detok worker answered for the first two tokens; the third is still in flight there.
    event = state.take_event(detok_worker_pb2.TextDelta(sequence_id="r", text="ab", num_tokens=2))
    assert event.token_ids == [1, 2]
    event = state.take_event(detok_worker_pb2.TextDelta(sequence_id="r", text="c", num_tokens=1))
    assert event.token_ids == [3]


def test_prompt_logprobs_ride_on_the_first_event_only() -> None:
    seq = tokens([10])
    seq.prompt_logprobs = pack_float32([float("nan"), -1.5, -0.5])
    seq.num_prompt_top_logprobs = 1
    seq.prompt_top_token_ids = pack_int32([-1, 7, 8])
    seq.prompt_top_logprobs = pack_float32([float("nan"), -1.0, -0.5])
    prompt = prompt_logprobs_of(seq)
    assert prompt.logprobs == [None, -1.5, -0.5]
    assert prompt.top_logprobs == [[], [(7, -1.0)], [(8, -0.5)]]
    state = RequestState("r", 3)
    state.prompt_logprobs = prompt
    state.record_tokens(seq)
    assert state.take_event(delta("a")).prompt_logprobs == prompt
    state.record_tokens(tokens([11]))
    assert state.take_event(delta("b")).prompt_logprobs is None
