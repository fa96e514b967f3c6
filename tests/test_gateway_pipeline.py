"""Unit tests of the pipeline's dispatch: one AddRequest for n outputs, SequenceTokens.index routing
each output to its own detok sequence and choice, stop strings ending one choice at a time.

The worker streams are not opened: the test marks them connected, plays the model worker's
TokenFrames and the detok worker's TextDeltaFrames into the reader callbacks, and reads what
the pipeline queued for the workers and yielded to the HTTP side.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.config import Config
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.request_mapping import GenerationParams
from gateway.token_rendering import DetokRenderer
from tests.test_gateway_metrics import sample
from tokenwire.packing import pack_float32, pack_int32, unpack_int32
from tokenwire.v1 import common_pb2, detok_worker_pb2, model_worker_pb2

STOP = model_worker_pb2.FINISH_REASON_STOP
LENGTH = model_worker_pb2.FINISH_REASON_LENGTH


@pytest.fixture
async def pipeline():
    config = Config(model_workers=["127.0.0.1:9"], detok_workers=["127.0.0.1:9"])
    p = Pipeline(config)
    p.model_info = model_worker_pb2.ModelInfo(tokenizer=common_pb2.TokenizerIdentity(path="/t", sha256="00"))
    p.model = p.model_workers.replicas[0]  # the one replica, which the tests play
    for stream in (p.model.stream, p.detoks[0].stream):
        stream._connected.set()  # as if the bidi calls were open; nothing is sent
    yield p
    await p.close()


@pytest.fixture
async def two_detoks():
    """A pipeline with two detok replicas (and its one model worker replica as .model)."""
    config = Config(model_workers=["127.0.0.1:9"], detok_workers=["127.0.0.1:9", "127.0.0.1:10"])
    p = Pipeline(config)
    p.model_info = model_worker_pb2.ModelInfo(tokenizer=common_pb2.TokenizerIdentity(path="/t", sha256="00"))
    p.model = p.model_workers.replicas[0]
    for stream in (p.model.stream, *(d.stream for d in p.detoks)):
        stream._connected.set()
    yield p
    await p.close()


def tokens(request_id: str, index: int, ids: list[int], finish: int = 0) -> model_worker_pb2.SequenceTokens:
    return model_worker_pb2.SequenceTokens(request_id=request_id, index=index, token_ids=pack_int32(ids),
                                           finish_reason=finish, num_output_tokens=len(ids))


def tokens_with_top_logprob(request_id: str) -> model_worker_pb2.SequenceTokens:
    """Tokens 5 and 6 with their logprobs and one alternative each (9 for 5, 6 for 6)."""
    seq = tokens(request_id, 0, [5, 6])
    seq.logprobs = pack_float32([-0.5, -0.25])
    seq.num_top_logprobs = 1
    seq.top_token_ids = pack_int32([9, 6])
    seq.top_logprobs = pack_float32([-0.4, -0.25])
    return seq


def text(sequence_id: str, value: str, finished: bool = False, **fields: int) -> detok_worker_pb2.TextDelta:
    return detok_worker_pb2.TextDelta(sequence_id=sequence_id, text=value, finished=finished,
                                      stop_index=fields.pop("stop_index", -1), **fields)


async def test_n_outputs_are_one_request_routed_by_index(pipeline: Pipeline) -> None:
    events: list[tuple[int, str, str | None]] = []

    async def consume() -> None:
        async for index, event in pipeline.generate([1, 2, 3], GenerationParams(n=2)):
            events.append((index, event.text, event.finish_reason))

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    (add,) = pipeline.model._take_frame().adds  # as the sender would write it
    assert add.n == 2 and list(add.prompt_token_ids) == [1, 2, 3]
    rid = add.request_id
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(rid, 1, [7]), tokens(rid, 0, [5])]))
    detok = pipeline.detoks[0]
    frame = detok._take_frame()
    assert [o.sequence_id for o in frame.opens] == [f"{rid}-1", f"{rid}-0"]
    # No logprobs: the outputs have handles, their ids go as TokenColumns rows.
    handles = {o.sequence_id: o.handle for o in frame.opens}
    assert sorted(handles.values()) == [1, 2] and not frame.tokens
    rows = dict(zip(unpack_int32(frame.columns.handles).tolist(), unpack_int32(frame.columns.token_ids).tolist(),
                    strict=True))
    assert rows == {handles[f"{rid}-1"]: 7, handles[f"{rid}-0"]: 5}
    pipeline._on_text_delta_frame(pipeline.detoks[0], detok_worker_pb2.TextDeltaFrame(deltas=[text(f"{rid}-1", "b")]))
    # Output 1 hits a stop string: only it is aborted on the model worker; output 0 goes on.
    pipeline._on_text_delta_frame(pipeline.detoks[0], detok_worker_pb2.TextDeltaFrame(deltas=[
        text(f"{rid}-1", "!", finished=True, stop_index=0, num_tokens_to_stop=1)]))
    (abort,) = pipeline.model._take_frame().aborts
    assert (abort.request_id, list(abort.indexes)) == (rid, [1])
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(rid, 1, [8]), tokens(rid, 0, [6])]))
    assert set(detok._rows) == {handles[f"{rid}-0"]}  # the stopped output's later tokens go nowhere
    # The worker's answer to that abort ends output 1 there, and fails nothing.
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[
        tokens(rid, 1, [], model_worker_pb2.FINISH_REASON_ABORT), tokens(rid, 0, [7], LENGTH)]))
    assert pipeline.num_live_requests == 1
    pipeline._on_text_delta_frame(pipeline.detoks[0], detok_worker_pb2.TextDeltaFrame(deltas=[text(f"{rid}-0", "ac", finished=True)]))
    await asyncio.wait_for(task, 5)
    assert events == [(1, "b", None), (1, "!", "stop"), (0, "ac", "length")]
    # Every output ended on the model worker: nothing more to abort.
    assert not pipeline.model._aborts and pipeline.num_live_requests == 0


async def test_a_refusal_fails_the_whole_request(pipeline: Pipeline) -> None:
    pipeline.metrics = GatewayMetrics()
    generator = pipeline.generate([1], GenerationParams(n=3))
    pending = asyncio.create_task(anext(generator))
    await asyncio.sleep(0)
    (add,) = pipeline.model._take_frame().adds
    refusal = model_worker_pb2.SequenceTokens(
        request_id=add.request_id, finish_reason=model_worker_pb2.FINISH_REASON_ERROR,
        error=model_worker_pb2.RequestError(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="full"))
    pipeline._on_replica_token_frame(pipeline.model, model_worker_pb2.TokenFrame(sequences=[refusal]))
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(pending, 5)
    assert info.value.status == 429 and info.value.headers["Retry-After"]
    assert pipeline.num_live_requests == 0 and not pipeline.model._aborts
    # Counted against the replica that refused it, once (review 101: refusals left no trace).
    assert sample(pipeline.metrics.render().decode(), "tokenwire:model_worker_rpc_errors_total",
                  worker=pipeline.model.address, rpc="AddRequest", code="RESOURCE_EXHAUSTED") == 1


async def test_failing_the_open_requests_fails_the_later_ones_too(pipeline: Pipeline) -> None:
    """The drain's 503 a second before its grace ends: a request still being tokenized then
    reaches the pipeline later, and uvicorn would cut it at the grace's end (review 89)."""
    running = pipeline.generate([1], GenerationParams())
    pending = asyncio.create_task(anext(running))
    await asyncio.sleep(0)
    pipeline.fail_open_requests("shutting down")
    for generator in (running, pipeline.generate([2], GenerationParams())):
        with pytest.raises(APIError) as info:
            await asyncio.wait_for(pending if generator is running else anext(generator), 5)
        assert info.value.status == 503 and info.value.message == "shutting down"
    assert pipeline.num_live_requests == 0


async def test_an_index_beyond_n_is_a_worker_fault(pipeline: Pipeline) -> None:
    generator = pipeline.generate([1], GenerationParams(n=1))
    pending = asyncio.create_task(anext(generator))
    await asyncio.sleep(0)
    (add,) = pipeline.model._take_frame().adds
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(add.request_id, 1, [4])]))
    with pytest.raises(APIError, match="output 1 of a request for 1"):
        await asyncio.wait_for(pending, 5)


async def test_losing_the_model_stream_fails_only_requests_it_had_not_finished(pipeline: Pipeline) -> None:
    """A draining model worker ends its stream right after its requests' last frames; one whose
    outputs all ended there only waits for its last text from the detok worker, and completes."""
    done_events, cut_events = [], []

    async def consume(generator, events) -> None:
        async for _, event in generator:
            events.append((event.text, event.finish_reason))

    done = asyncio.create_task(consume(pipeline.generate([1], GenerationParams(n=1)), done_events))
    cut = asyncio.create_task(consume(pipeline.generate([2], GenerationParams(n=1)), cut_events))
    await asyncio.sleep(0)
    done_id, cut_id = [add.request_id for add in pipeline.model._take_frame().adds]
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(done_id, 0, [5], LENGTH),
                                                                    tokens(cut_id, 0, [6])]))
    pipeline._on_model_lost(pipeline.model, RuntimeError("model worker ended the stream"))
    with pytest.raises(APIError, match="lost the model worker stream"):
        await asyncio.wait_for(cut, 5)
    pipeline._on_text_delta_frame(pipeline.detoks[0], detok_worker_pb2.TextDeltaFrame(deltas=[text(f"{done_id}-0", "hi", finished=True)]))
    await asyncio.wait_for(done, 5)
    assert done_events == [("hi", "length")] and pipeline.num_live_requests == 0


async def test_a_request_that_cannot_be_forwarded_fails_alone(pipeline: Pipeline) -> None:
    # A stop string protobuf cannot encode (the gateway's validation refuses these; this is
    # the line behind it): its OpenSequence fails, the frame's other request goes on.
    bad = pipeline.generate([1], GenerationParams(stop=("\ud800",)))
    good = pipeline.generate([2], GenerationParams())
    bad_first, good_first = asyncio.create_task(anext(bad)), asyncio.create_task(anext(good))
    await asyncio.sleep(0)
    bad_add, good_add = pipeline.model._take_frame().adds
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[
        tokens(bad_add.request_id, 0, [4]), tokens(good_add.request_id, 0, [5])]))
    with pytest.raises(APIError, match="could not forward") as info:
        await asyncio.wait_for(bad_first, 5)
    assert info.value.status == 500
    (abort,) = pipeline.model._take_frame().aborts
    assert abort.request_id == bad_add.request_id
    (opened,) = pipeline.detoks[0]._take_frame().opens
    assert opened.sequence_id == f"{good_add.request_id}-0"
    pipeline._on_text_delta_frame(pipeline.detoks[0], detok_worker_pb2.TextDeltaFrame(deltas=[text(opened.sequence_id, "x", True)]))
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(good_add.request_id, 0, [], LENGTH)]))
    _, event = await asyncio.wait_for(good_first, 5)
    assert event.text == "x"
    await bad.aclose()
    await good.aclose()


async def test_losing_a_detok_replica_moves_its_requests_and_the_client_reads_on_where_it_was(
        two_detoks: Pipeline) -> None:
    """A request still waiting for its first token opens on the other replica with it; one whose
    sequence was open reopens there with every id it was sent, and the text the client already
    has is skipped. Before, the second failed with 503 although the gateway had all its ids."""
    p, model = two_detoks, two_detoks.model
    lost, kept = p.detoks
    p.metrics = GatewayMetrics()
    running, other, waiting = (p.generate([i], GenerationParams()) for i in (1, 2, 3))
    firsts = [asyncio.create_task(anext(g)) for g in (running, other, waiting)]
    await asyncio.sleep(0)
    adds = model._take_frame().adds
    assert [p._live[a.request_id].detok for a in adds] == [lost, kept, lost]  # least loaded first
    sequence = f"{adds[0].request_id}-0"
    p._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(adds[0].request_id, 0, [4])]))
    p._on_text_delta_frame(p.detoks[0], detok_worker_pb2.TextDeltaFrame(deltas=[text(sequence, "ab", num_tokens=1)]))
    _, event = await asyncio.wait_for(firsts[0], 5)
    assert event.text == "ab" and event.token_ids == [4]
    p._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(adds[0].request_id, 0, [5])]))  # unanswered
    lost.stream._connected.clear()
    p._on_detok_lost(p.detoks[0], ConnectionError("gone"))
    assert p._live[adds[0].request_id].detok is kept and p._live[adds[2].request_id].detok is kept
    assert (lost.num_open_sequences, kept.num_open_sequences) == (0, 3)
    reopened = sample(p.metrics.render().decode(), "tokenwire:detok_sequences_reopened_total", worker="127.0.0.1:10")
    assert reopened == 1  # the open one; the other opens later
    reopened = kept._take_frame()
    assert [o.sequence_id for o in reopened.opens] == [sequence] and reopened.opens[0].prompt_tail_ids == [1]
    assert unpack_int32(reopened.columns.token_ids).tolist() == [4, 5]  # every id it was sent
    assert unpack_int32(reopened.columns.handles).tolist() == [reopened.opens[0].handle]
    assert not reopened.columns.finished_handles
    # The new replica's text starts from the first id: the client reads on after "ab".
    after = asyncio.create_task(anext(running))
    p._on_text_delta_frame(p.detoks[1], detok_worker_pb2.TextDeltaFrame(deltas=[text(sequence, "a", num_tokens=1)]))
    await asyncio.sleep(0)
    assert not after.done()  # all of it the client had
    p._on_text_delta_frame(p.detoks[1], detok_worker_pb2.TextDeltaFrame(deltas=[text(sequence, "bc", num_tokens=1)]))
    _, event = await asyncio.wait_for(after, 5)
    assert event.text == "c" and event.token_ids == [5]
    p._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(adds[0].request_id, 0, [6], LENGTH)]))
    assert unpack_int32(kept._take_frame().columns.token_ids).tolist() == [6]
    p._on_text_delta_frame(p.detoks[1], detok_worker_pb2.TextDeltaFrame(deltas=[text(sequence, "d", True, num_tokens=1)]))
    _, event = await anext(running)
    assert event.text == "d" and event.token_ids == [6] and event.finish_reason == "length"
    # The one still waiting for its first token opens on the other replica with it.
    p._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(adds[2].request_id, 0, [5], LENGTH)]))
    (opened,) = kept._take_frame().opens
    assert opened.sequence_id == f"{adds[2].request_id}-0"
    p._on_text_delta_frame(p.detoks[1], detok_worker_pb2.TextDeltaFrame(deltas=[text(opened.sequence_id, "y", True)]))
    _, event = await asyncio.wait_for(firsts[2], 5)
    assert event.text == "y" and event.finish_reason == "length"
    firsts[1].cancel()
    await asyncio.gather(firsts[1], return_exceptions=True)
    for generator in (running, other, waiting):
        await generator.aclose()
    assert (lost.num_open_sequences, kept.num_open_sequences) == (0, 0)


async def test_a_reopened_sequence_asks_the_new_replica_for_the_renders_it_never_got(two_detoks: Pipeline) -> None:
    async def no_rpc(ids: object) -> detok_worker_pb2.RenderedTokens:
        raise AssertionError("every id comes rendered with the stream")

    p, model = two_detoks, two_detoks.model
    lost, kept = p.detoks
    p.renderer = DetokRenderer(no_rpc)
    generator = p.generate([1], GenerationParams(logprobs=True, top_logprobs=1))
    first = asyncio.create_task(anext(generator))
    await asyncio.sleep(0)
    (add,) = model._take_frame().adds
    seq = tokens_with_top_logprob(add.request_id)
    p._on_token_frame(model_worker_pb2.TokenFrame(sequences=[seq]))
    lost.stream._connected.clear()
    p._on_detok_lost(p.detoks[0], ConnectionError("gone"))
    reopened = kept._take_frame()
    (entry,) = reopened.tokens
    assert entry.sequence_id == f"{add.request_id}-0" and not reopened.opens[0].handle
    assert unpack_int32(entry.token_ids).tolist() == [5, 6]
    assert unpack_int32(entry.render_token_ids).tolist() == [5, 9, 6, 6]
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await generator.aclose()


async def test_losing_the_only_connected_detok_replica_fails_its_open_requests(two_detoks: Pipeline) -> None:
    p, model = two_detoks, two_detoks.model
    lost, down = p.detoks
    down.stream._connected.clear()
    generator = p.generate([1], GenerationParams())
    first = asyncio.create_task(anext(generator))
    await asyncio.sleep(0)
    (add,) = model._take_frame().adds
    p._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(add.request_id, 0, [4])]))
    lost.stream._connected.clear()
    p._on_detok_lost(p.detoks[0], ConnectionError("gone"))
    with pytest.raises(APIError, match="lost the detok worker stream") as info:
        await asyncio.wait_for(first, 5)
    assert info.value.status == 503
    await generator.aclose()


async def test_a_request_assigned_to_a_draining_detok_replica_opens_on_another(two_detoks: Pipeline) -> None:
    p, model = two_detoks, two_detoks.model
    draining, other = p.detoks
    generator = p.generate([1], GenerationParams())
    first = asyncio.create_task(anext(generator))
    await asyncio.sleep(0)
    (add,) = model._take_frame().adds
    assert p._live[add.request_id].detok is draining
    draining.health.serving = False  # SIGTERM: its health turned NOT_SERVING
    p._on_token_frame(model_worker_pb2.TokenFrame(sequences=[tokens(add.request_id, 0, [5])]))
    assert draining._take_frame() is None
    (opened,) = other._take_frame().opens
    assert opened.sequence_id == f"{add.request_id}-0"
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await generator.aclose()
    assert (draining.num_open_sequences, other.num_open_sequences) == (0, 0)


async def test_logprob_tokens_are_rendered_by_the_detok_worker_as_they_stream(pipeline: Pipeline) -> None:
    async def no_rpc(ids: object) -> detok_worker_pb2.RenderedTokens:
        raise AssertionError("every id came rendered with the stream")

    pipeline.renderer = DetokRenderer(no_rpc)
    generator = pipeline.generate([1], GenerationParams(logprobs=True, top_logprobs=1))
    pending = asyncio.create_task(anext(generator))
    await asyncio.sleep(0)
    (add,) = pipeline.model._take_frame().adds
    seq = tokens_with_top_logprob(add.request_id)
    pipeline._on_token_frame(model_worker_pb2.TokenFrame(sequences=[seq]))
    (entry,) = pipeline.detoks[0]._take_frame().tokens
    assert entry.render_token_ids == pack_int32([5, 9, 6, 6])  # each token, then its alternative
    delta = text(f"{add.request_id}-0", "xy", num_tokens=2)
    pieces = [b"x", b" nine", b"y", b"y"]
    offsets = [0, 1, 6, 7, 8]
    delta.rendered.CopyFrom(detok_worker_pb2.RenderedTokens(text=[p.decode() for p in pieces], data=b"".join(pieces),
                                                            offsets=pack_int32(offsets)))
    pipeline._on_text_delta_frame(pipeline.detoks[0], detok_worker_pb2.TextDeltaFrame(deltas=[delta]))
    index, event = await asyncio.wait_for(pending, 5)
    assert index == 0 and event.token_ids == [5, 6]
    await pipeline.renderer.ensure([5, 6, 9])
    assert [pipeline.renderer.token_text(t) for t in (5, 9, 6)] == ["x", " nine", "y"]
    assert pipeline.renderer.token_bytes(9) == b" nine"
    await generator.aclose()


def test_a_lost_stream_tells_the_client_grpc_status_not_the_error_repr() -> None:
    from grpc.aio import AioRpcError, Metadata

    from gateway.frame_stream import why_lost

    error = AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(), details="Socket closed",
                        debug_error_string="UNAVAILABLE: ipv4:10.0.0.7:50051 Socket closed")
    assert why_lost(error) == "UNAVAILABLE: Socket closed"
    assert why_lost(AioRpcError(grpc.StatusCode.INTERNAL, Metadata(), Metadata())) == "INTERNAL"
    assert why_lost(ConnectionError("model worker 10.0.0.7:50051 ended the stream")) == "the worker ended the stream"
    from gateway.frame_stream import ResetStream
    assert why_lost(ResetStream("the detok worker answered no frame for 15 s")) == (
        "the detok worker answered no frame for 15 s")
