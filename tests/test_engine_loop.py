"""EngineLoop with a scripted engine (no model): steps run on the engine thread, back to back,
and only adds, aborts and outputs cross to the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest

from model_worker import engine_loop
from model_worker.engine import RequestRejected, SequenceOutput
from model_worker.engine_loop import EngineLoop, NewRequest, OutputHandover, RequestFailure, StreamOutbox
from model_worker.sequence import FinishReason, SamplingParams
from model_worker.servicer import ModelWorkerServicer
from model_worker.structured_output import Constraint
from tokenwire.v1 import model_worker_pb2 as pb

REPO_ROOT = Path(__file__).resolve().parent.parent
BUG_PROMPT = 666


class ScriptedEngine:
    """Each live request gets one token per step (token = step number) until max_tokens.
    Touched only from the engine thread: it records every thread that calls it."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.max_waiting_requests = 1024
        self.live: dict[int, list[int]] = {}  # seq_id -> [tokens left, tokens made]
        self.steps = 0
        self.fail_next_step = False
        self.fail_every_step = False
        self.fail_next_abort = False
        self.threads: set[str] = set()

    def _on_thread(self) -> None:
        self.threads.add(threading.current_thread().name)

    def add_request(self, seq_id, prompt_token_ids, sampling, max_tokens, stop_token_ids, ignore_eos,
                    n=1, best_of=0, grammar=None, grammar_wait=None, cache_salt=""):
        self._on_thread()
        if not prompt_token_ids:
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if prompt_token_ids == [BUG_PROMPT]:  # a bug in the engine, not bad input
            raise ValueError("scripted add failure")
        self.live[seq_id] = [max_tokens, 0]

    def abort_request(self, seq_id):
        self._on_thread()
        if self.fail_next_abort:
            self.fail_next_abort = False
            raise RuntimeError("scripted abort failure")
        if self.live.pop(seq_id, None) is None:
            return []
        return [SequenceOutput(seq_id, None, finish_reason=FinishReason.ABORT, request_finished=True)]

    def abort_outputs(self, seq_id, indexes):
        self._on_thread()
        return []

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> list[SequenceOutput]:
        self._on_thread()
        self.steps += 1
        if self.fail_next_step or self.fail_every_step:
            self.fail_next_step = False
            raise RuntimeError("scripted step failure")
        if self.step_s:
            time.sleep(self.step_s)
        outputs = []
        for seq_id, state in list(self.live.items()):
            state[0] -= 1
            state[1] += 1
            done = state[0] == 0
            outputs.append(SequenceOutput(seq_id, self.steps, num_output_tokens=state[1],
                                          finish_reason=FinishReason.LENGTH if done else FinishReason.NONE,
                                          request_finished=done))
            if done:
                del self.live[seq_id]
        return outputs


def new_request(request_id: str, max_tokens: int, prompt: list[int] | None = None) -> NewRequest:
    return NewRequest(request_id=request_id, prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
                      sampling=SamplingParams(), max_tokens=max_tokens, stop_token_ids=[], ignore_eos=True)


async def collect(outbox: StreamOutbox, request_ids: set[str], timeout_s: float = 10.0) -> dict[str, list]:
    """Queue items per request until each has ended (a finished output or a failure)."""
    items: dict[str, list] = {r: [] for r in request_ids}
    pending = set(request_ids)
    while pending:
        item = await asyncio.wait_for(outbox.queue.get(), timeout_s)
        if isinstance(item, RequestFailure):
            items[item.request_id].append(item)
            pending.discard(item.request_id)
            continue
        request_id, out = item
        items[request_id].append(out)
        if out.request_finished:
            pending.discard(request_id)
    return items


@pytest.fixture
async def started():
    loops = []

    def start(engine: ScriptedEngine) -> EngineLoop:
        loop = EngineLoop(engine)
        loop.start()
        loops.append(loop)
        return loop

    yield start
    for loop in loops:
        await loop.stop()


async def test_outputs_arrive_in_order_and_ended_requests_leave_live(started):
    engine = ScriptedEngine()
    loop = started(engine)
    outbox = StreamOutbox()
    loop.add(outbox, new_request("a", 5))
    loop.add(outbox, new_request("b", 3))
    items = await collect(outbox, {"a", "b"})
    assert [o.num_output_tokens for o in items["a"]] == [1, 2, 3, 4, 5]
    assert [o.num_output_tokens for o in items["b"]] == [1, 2, 3]
    assert items["a"][-1].finish_reason == FinishReason.LENGTH
    assert not outbox.live
    # The engine was only ever touched from the engine thread.
    assert engine.threads and all(name.startswith("engine-step") for name in engine.threads)


async def test_rejected_and_aborted_requests_end_once(started):
    engine = ScriptedEngine(step_s=0.002)
    loop = started(engine)
    outbox = StreamOutbox()
    loop.add(outbox, new_request("empty", 4, prompt=[]))
    loop.add(outbox, new_request("long", 10_000))
    loop.add(outbox, new_request("gone", 10_000))
    loop.abort(outbox, "gone")  # aborted before the engine thread has even added it
    first = await collect(outbox, {"empty", "gone"})
    [failure] = first["empty"]
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in failure.message
    assert first["gone"][-1].finish_reason == FinishReason.ABORT
    loop.abort(outbox, "long")
    rest = await collect(outbox, {"long"})
    assert rest["long"][-1].finish_reason == FinishReason.ABORT
    assert not outbox.live
    loop.abort(outbox, "long")  # already ended: nothing more comes
    await asyncio.sleep(0.05)
    assert outbox.queue.empty()


async def test_a_request_ended_with_a_failure_gets_it_as_its_one_last_item(started):
    """What a second add of a live request_id does (servicer): the live request ends with the
    failure in place of its abort output, after its tokens and with none after it."""
    engine = ScriptedEngine(step_s=0.002)
    loop = started(engine)
    outbox = StreamOutbox()
    loop.add(outbox, new_request("running", 10_000))
    while engine.steps < 3:  # it has made tokens
        await asyncio.sleep(0.002)
    failure = RequestFailure("running", grpc.StatusCode.INVALID_ARGUMENT, "added again")
    loop.abort(outbox, "running", failure)
    again = RequestFailure("running", grpc.StatusCode.INVALID_ARGUMENT, "added a third time")
    loop.abort(outbox, "running", again)  # a third add before the first end lands: refused after it
    items = (await collect(outbox, {"running"}))["running"]
    assert items[-1] is failure
    assert items[:-1] and all(isinstance(o, SequenceOutput) and not o.request_finished for o in items[:-1])
    assert await asyncio.wait_for(outbox.queue.get(), 5) is again
    await asyncio.sleep(0.05)
    assert outbox.queue.empty() and not outbox.live and not engine.live


async def test_a_failure_for_a_request_that_ended_meanwhile_still_goes_out(started):
    """A duplicate add seen while the request's end was still on its way to the event loop: the
    request keeps its own last item, and the refusal follows it (each add is answered)."""
    engine = ScriptedEngine()
    loop = started(engine)
    outbox = StreamOutbox()
    loop.add(outbox, new_request("r", 2))
    deadline = time.monotonic() + 5
    while (engine.steps < 2 or engine.live) and time.monotonic() < deadline:
        time.sleep(0.001)  # the event loop is held: the end is not delivered yet
    assert "r" in outbox.live
    failure = RequestFailure("r", grpc.StatusCode.INVALID_ARGUMENT, "added again")
    loop.abort(outbox, "r", failure)
    items = (await collect(outbox, {"r"}))["r"]
    assert items[-1].finish_reason == FinishReason.LENGTH
    assert await asyncio.wait_for(outbox.queue.get(), 5) is failure
    await asyncio.sleep(0.05)
    assert outbox.queue.empty() and not outbox.live and outbox.unanswered == 0


async def test_a_failed_step_fails_its_requests_and_the_loop_serves_on(started):
    engine = ScriptedEngine()
    loop = started(engine)
    outbox = StreamOutbox()
    engine.fail_next_step = True
    loop.add(outbox, new_request("doomed", 50))
    [failure] = (await collect(outbox, {"doomed"}))["doomed"]
    assert failure.code == grpc.StatusCode.INTERNAL
    assert not outbox.live
    loop.add(outbox, new_request("after", 2))
    after = await collect(outbox, {"after"})
    assert after["after"][-1].finish_reason == FinishReason.LENGTH


async def test_an_abort_that_fails_with_a_bug_ends_that_request_only(started):
    # It still gets its last item (the stream would wait for it for ever), and the request beside
    # it is not failed with it (every request of the worker was).
    engine = ScriptedEngine(step_s=0.001)
    loop = started(engine)
    outbox = StreamOutbox()
    loop.add(outbox, new_request("aborted", 10_000))
    loop.add(outbox, new_request("beside", 30))
    await collect_first(outbox)
    engine.fail_next_abort = True
    loop.abort(outbox, "aborted")
    items = await collect(outbox, {"aborted", "beside"})
    assert isinstance(items["aborted"][-1], RequestFailure) and items["aborted"][-1].code == grpc.StatusCode.INTERNAL
    assert items["beside"][-1].finish_reason == FinishReason.LENGTH
    assert not outbox.live and outbox.unanswered == 0
    assert loop.healthy


async def test_steps_that_keep_failing_make_the_loop_unhealthy(started):
    engine = ScriptedEngine()
    loop = started(engine)
    outbox = StreamOutbox()
    engine.fail_next_step = True
    loop.add(outbox, new_request("one", 5))
    await collect(outbox, {"one"})
    assert loop.healthy  # one failure: that step's requests end, the worker serves on
    engine.fail_every_step = True
    for i in range(engine_loop.MAX_FAILED_STEPS_IN_A_ROW):
        loop.add(outbox, new_request(f"r{i}", 5))
        [failure] = (await collect(outbox, {f"r{i}"}))[f"r{i}"]
        assert failure.code == grpc.StatusCode.INTERNAL
    assert not loop.healthy


async def test_the_model_worker_says_not_serving_once_its_engine_cannot_serve():
    from grpc_health.v1 import health, health_pb2

    from model_worker.__main__ import watch_engine

    class Loop:
        healthy = True

    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    fake = Loop()
    watcher = asyncio.create_task(watch_engine(fake, servicer, poll_s=0.01))
    await asyncio.sleep(0.05)
    request = health_pb2.HealthCheckRequest(service="")
    assert (await servicer.Check(request, None)).status == health_pb2.HealthCheckResponse.SERVING
    fake.healthy = False
    # And why, for serve() to end the process (exit_hung): a worker that only said NOT_SERVING ran
    # on, and nothing but a Kubernetes liveness probe restarted it.
    assert "exits to be restarted" in await asyncio.wait_for(watcher, 5)
    assert (await servicer.Check(request, None)).status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_steps_do_not_wait_for_the_event_loop(started):
    """While the event loop is busy (here: blocked for 0.3 s), the engine thread keeps stepping;
    when each step needed the event loop to start it, no step ran in such a stretch."""
    engine = ScriptedEngine(step_s=0.001)
    loop = started(engine)
    outbox = StreamOutbox()
    loop.add(outbox, new_request("long", 100_000))
    await collect_first(outbox)
    steps_before = engine.steps
    time.sleep(0.3)  # blocks the event loop, not the engine thread
    steps_during = engine.steps - steps_before
    assert steps_during >= 20, steps_during
    loop.abort(outbox, "long")
    items = await collect(outbox, {"long"})
    # Every step's token arrived, in order, after the event loop was free again.
    tokens = [o.token_id for o in items["long"] if o.token_id is not None]
    assert tokens == sorted(tokens) and len(tokens) >= steps_during


async def collect_first(outbox: StreamOutbox) -> None:
    await asyncio.wait_for(outbox.queue.get(), 10)


async def test_stop_hands_over_the_last_outputs_and_ends_the_threads():
    engine = ScriptedEngine(step_s=0.001)
    loop = EngineLoop(engine)
    loop.start()
    outbox = StreamOutbox()
    loop.add(outbox, new_request("a", 10_000))
    await collect_first(outbox)
    await asyncio.wait_for(loop.stop(), 10)
    made = engine.steps
    delivered = 1
    while not outbox.queue.empty():
        outbox.queue.get_nowait()
        delivered += 1
    assert delivered == made  # every step that ran reached the outbox before stop() returned
    assert not any(t.name == "engine-outputs" for t in threading.enumerate())


async def test_handover_keeps_order_across_many_batches():
    received: list[int] = []
    handover = OutputHandover(asyncio.get_running_loop(), received.extend)
    for start in range(0, 5000, 10):
        handover.put(list(range(start, start + 10)))
    await asyncio.to_thread(handover.close)
    await asyncio.sleep(0)
    assert received == list(range(5000))


async def test_an_add_that_fails_with_a_bug_ends_that_request_only(started):
    engine = ScriptedEngine(step_s=0.001)
    loop = started(engine)
    outbox = StreamOutbox()
    loop.add(outbox, new_request("running", 30))
    await collect_first(outbox)
    loop.add(outbox, new_request("buggy", 5, prompt=[BUG_PROMPT]))
    loop.add(outbox, new_request("after", 3))  # same pass as the failing add
    items = await collect(outbox, {"running", "buggy", "after"})
    [failure] = items["buggy"]
    assert failure.code == grpc.StatusCode.INTERNAL
    assert items["after"][-1].finish_reason == FinishReason.LENGTH
    assert items["running"][-1].finish_reason == FinishReason.LENGTH  # not failed with it
    assert not outbox.live


async def test_stop_during_the_step_that_empties_the_engine_returns():
    """stop() lands while the last request's last step runs: the thread must not go to sleep
    waiting for work after it."""
    engine = ScriptedEngine(step_s=0.3)
    loop = EngineLoop(engine)
    loop.start()
    outbox = StreamOutbox()
    loop.add(outbox, new_request("last", 1))
    while engine.steps == 0:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(loop.stop(), 5)
    [out] = (await collect(outbox, {"last"}))["last"]
    assert out.finish_reason == FinishReason.LENGTH


class ControlledCompiler:
    """Grammar compiles that finish when the test says."""

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def submit(self, constraint) -> Future:
        self.futures.append(Future())
        return self.futures[-1]


@pytest.mark.parametrize("with_failure", [False, True], ids=["abort", "failure"])
async def test_abort_while_compiling_ends_once_and_never_runs(with_failure: bool):
    """A client's abort ends it with ABORT; a duplicate add's failure (servicer) with that failure."""
    engine = ScriptedEngine(step_s=0.001)
    compiler = ControlledCompiler()
    loop = EngineLoop(engine, compiler)
    loop.start()
    try:
        outbox = StreamOutbox()
        request = new_request("constrained", 10_000)
        request.constraint = Constraint("regex", "a+")
        loop.add(outbox, request)
        failure = RequestFailure("constrained", grpc.StatusCode.INVALID_ARGUMENT, "added again") if with_failure else None
        loop.abort(outbox, "constrained", failure)
        compiler.futures[0].set_result(object())  # the compile finishes after the abort
        [out] = (await collect(outbox, {"constrained"}))["constrained"]
        assert out is failure if with_failure else out.finish_reason == FinishReason.ABORT
        await asyncio.sleep(0.05)
        assert outbox.queue.empty() and not outbox.live
        assert engine.steps == 0 and not engine.live  # it never reached the engine
    finally:
        await loop.stop()


async def test_requests_waiting_for_their_grammars_count_against_the_waiting_room():
    # The engine counts a request once it is added: compiles (each up to seconds) queued without bound.
    engine = ScriptedEngine(step_s=0.001)
    engine.max_waiting_requests = 2
    compiler = ControlledCompiler()
    loop = EngineLoop(engine, compiler)
    loop.start()
    try:
        outbox = StreamOutbox()
        for name in ("a", "b", "c"):
            request = new_request(name, 2)
            request.constraint = Constraint("regex", "a+")
            loop.add(outbox, request)
        [refused] = (await collect(outbox, {"c"}))["c"]
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting for their grammars" in refused.message
        assert len(compiler.futures) == 2 and "c" not in outbox.live
        for future in compiler.futures:
            future.set_result(object())
        items = await collect(outbox, {"a", "b"})
        assert [items[name][-1].finish_reason for name in ("a", "b")] == [FinishReason.LENGTH] * 2
    finally:
        await loop.stop()


def test_drained_only_once_the_last_output_is_framed():
    """The engine can be out of work while its last outputs still cross to a stream."""
    engine = ScriptedEngine()
    servicer = ModelWorkerServicer(EngineLoop(engine), pb.ModelInfo())
    assert servicer.is_drained()
    outbox = StreamOutbox()
    servicer._streams.add(outbox)
    outbox.live["r"] = 0
    assert not servicer.is_drained()  # running, or its end not handed over yet
    del outbox.live["r"]
    outbox.queue.put_nowait(("r", SequenceOutput(0, 7, request_finished=True)))
    assert not servicer.is_drained()  # its end waits in the queue
    outbox.queue.get_nowait()
    outbox.framing = True
    assert not servicer.is_drained()  # being framed and sent
    outbox.framing = False
    assert servicer.is_drained()
    engine.live[1] = [1, 0]
    assert not servicer.is_drained()  # the engine still has work (say, a closed stream's abort)


def test_a_stream_with_a_refusal_on_its_way_is_not_drained():
    """A duplicate add's refusal may come after the request it refused has ended (no request of the
    stream live any more): the stream stays open for it (StreamOutbox.unanswered)."""
    servicer = ModelWorkerServicer(EngineLoop(ScriptedEngine()), pb.ModelInfo())
    outbox = StreamOutbox()
    servicer._streams.add(outbox)
    assert servicer.is_drained()
    outbox.unanswered = 1
    assert not servicer.is_drained()


def test_drain_ends_each_generate_call_once_its_requests_have():
    """SIGTERM's begin_drain: an open Generate call whose client keeps its side open sends its
    requests' last frames and then ends by itself (status OK), so the server's final cancel finds
    nothing unsent; before, the call stayed open until that cancel, which could drop its last frame."""

    async def scenario() -> list[pb.TokenFrame]:
        loop = EngineLoop(ScriptedEngine(step_s=0.01))
        loop.start()
        servicer = ModelWorkerServicer(loop, pb.ModelInfo())
        client_open = asyncio.Event()  # never set: the client does not close its side

        async def requests():
            yield pb.RequestFrame(adds=[pb.AddRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=5)])
            await client_open.wait()

        frames: list[pb.TokenFrame] = []
        try:
            call = servicer.Generate(requests(), None)
            frames.append(await anext(call))
            servicer.begin_drain()
            async for frame in call:  # ends without a cancel once "r" has finished
                frames.append(frame)
        finally:
            await loop.stop()
        return frames

    frames = asyncio.run(asyncio.wait_for(scenario(), 10))
    last = [seq for frame in frames for seq in frame.sequences][-1]
    assert last.request_id == "r" and last.finish_reason == pb.FINISH_REASON_LENGTH and last.num_output_tokens == 5


def test_an_add_the_servicer_cannot_read_ends_that_request_only(monkeypatch):
    """A bug reading one add (sampling_from_proto raising) used to end the reading of the whole
    stream: the frame's other adds, and every later add and abort, were never seen."""
    from model_worker import servicer as servicer_module

    real = servicer_module.sampling_from_proto

    def sampling_from_proto(add):
        if add.request_id == "unreadable":
            raise RuntimeError("scripted read failure")
        return real(add)

    monkeypatch.setattr(servicer_module, "sampling_from_proto", sampling_from_proto)

    async def scenario() -> dict[str, pb.SequenceTokens]:
        loop = EngineLoop(ScriptedEngine(step_s=0.002))
        loop.start()
        servicer = ModelWorkerServicer(loop, pb.ModelInfo())

        async def requests():
            yield pb.RequestFrame(adds=[pb.AddRequest(request_id=i, prompt_token_ids=[1, 2], max_tokens=3)
                                        for i in ("before", "unreadable", "beside")])
            await asyncio.sleep(0.05)
            yield pb.RequestFrame(adds=[pb.AddRequest(request_id="later", prompt_token_ids=[1, 2], max_tokens=3)])

        last: dict[str, pb.SequenceTokens] = {}
        try:
            async for frame in servicer.Generate(requests(), None):
                for seq in frame.sequences:
                    if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        last[seq.request_id] = seq
        finally:
            await loop.stop()
        return last

    last = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert last["unreadable"].finish_reason == pb.FINISH_REASON_ERROR
    assert last["unreadable"].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert all(last[i].finish_reason == pb.FINISH_REASON_LENGTH for i in ("before", "beside", "later"))


def test_a_backlog_goes_out_in_bounded_frames(monkeypatch):
    """A client that stopped reading, then came back: its backlog is coalesced, but in frames of
    at most MAX_ITEMS_PER_FRAME outputs (one frame of all of it could pass gRPC's message limit)."""
    from model_worker import servicer as servicer_module

    monkeypatch.setattr(servicer_module, "MAX_ITEMS_PER_FRAME", 3)

    async def scenario() -> list[pb.TokenFrame]:
        loop = EngineLoop(ScriptedEngine())
        loop.start()
        servicer = ModelWorkerServicer(loop, pb.ModelInfo())

        async def requests():
            yield pb.RequestFrame(adds=[pb.AddRequest(request_id=f"r{i}", prompt_token_ids=[1, 2], max_tokens=20)
                                        for i in range(4)])

        frames: list[pb.TokenFrame] = []
        try:
            call = servicer.Generate(requests(), None)
            frames.append(await anext(call))
            await asyncio.sleep(0.3)  # not reading: every request runs to its end meanwhile
            frames += [frame async for frame in call]
        finally:
            await loop.stop()
        return frames

    frames = asyncio.run(asyncio.wait_for(scenario(), 10))
    tokens = {}
    for frame in frames:
        for seq in frame.sequences:
            tokens[seq.request_id] = tokens.get(seq.request_id, 0) + len(seq.token_ids) // 4
    assert tokens == {f"r{i}": 20 for i in range(4)}
    assert len(frames) >= 4 * 20 // 3 - 1 and all(len(f.sequences) <= 3 for f in frames)


def test_a_client_that_reads_nothing_gets_its_adds_refused_not_a_backlog(monkeypatch):
    """Past MAX_UNSENT_OUTPUTS outputs waiting for a stream, its new adds are refused with
    RESOURCE_EXHAUSTED until half have gone: a client that kept adding requests but read nothing
    grew the worker without bound (review 88). Its frames are still read (its end here): a stream
    that stopped reading them hung a client that writes before it reads (review 89)."""
    from model_worker import servicer as servicer_module

    monkeypatch.setattr(servicer_module, "MAX_UNSENT_OUTPUTS", 8)

    async def scenario() -> tuple[dict[str, int], dict[str, pb.SequenceTokens]]:
        loop = EngineLoop(ScriptedEngine(step_s=0.001))
        loop.start()
        servicer = ModelWorkerServicer(loop, pb.ModelInfo())
        incoming: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (frame := await incoming.get()) is not None:
                yield frame

        def adding(*request_ids: str) -> pb.RequestFrame:
            return pb.RequestFrame(adds=[pb.AddRequest(request_id=i, prompt_token_ids=[1, 2], max_tokens=40)
                                         for i in request_ids])

        tokens: dict[str, int] = {}
        last: dict[str, pb.SequenceTokens] = {}

        def count(frame: pb.TokenFrame) -> None:
            for seq in frame.sequences:
                tokens[seq.request_id] = tokens.get(seq.request_id, 0) + len(seq.token_ids) // 4
                if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    last[seq.request_id] = seq

        try:
            call = servicer.Generate(requests(), None)
            incoming.put_nowait(adding("first"))
            count(await anext(call))  # then nothing is read for a while
            (outbox,) = servicer._streams
            while "first" in outbox.live:
                await asyncio.sleep(0.005)
            incoming.put_nowait(adding("second", "third"))  # 39 outputs wait: refused
            await asyncio.sleep(0.05)
            count(await anext(call))  # the client reads again: the backlog goes in one frame
            incoming.put_nowait(adding("fourth"))  # taken again
            incoming.put_nowait(None)  # read as ever: the call ends once "fourth" has
            async for frame in call:
                count(frame)
        finally:
            await loop.stop()
        return tokens, last

    tokens, last = asyncio.run(asyncio.wait_for(scenario(), 10))
    for refused in ("second", "third"):
        assert last[refused].finish_reason == pb.FINISH_REASON_ERROR, last[refused]
        assert last[refused].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "wait for its client to read them" in last[refused].error.message
    assert tokens["first"] == tokens["fourth"] == 40
    assert last["fourth"].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_drain_waits_for_a_quiet_time_not_an_idle_instant():
    """grpc_server.wait_quiet, both workers' drain: idle, then work again within the quiet time
    (a gateway that had not seen NOT_SERVING yet), then idle across a whole quiet time."""
    from tokenwire.grpc_server import wait_quiet

    answers = iter([True, False, True, True])
    calls = []

    def idle() -> bool:
        calls.append(1)
        return next(answers)

    asyncio.run(asyncio.wait_for(wait_quiet(idle, quiet_s=0.01), 5))
    assert len(calls) == 4


def test_a_process_that_never_calls_stop_still_exits():
    """A startup error after start() must not leave the engine thread holding the process."""
    script = (
        "import asyncio\n"
        "from tests.test_engine_loop import ScriptedEngine\n"
        "from model_worker.engine_loop import EngineLoop\n"
        "async def main():\n"
        "    EngineLoop(ScriptedEngine()).start()\n"
        "    raise RuntimeError('startup failed')\n"
        "try:\n"
        "    asyncio.run(main())\n"
        "except RuntimeError:\n"
        "    pass\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, timeout=30, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


async def test_a_first_token_is_sent_before_the_next_step_starts(started, monkeypatch):
    """A pass that gives some request its first token waits until the event loop has taken it
    (and the Generate task it wakes has framed and sent it) before stepping on."""
    monkeypatch.setattr(engine_loop, "FIRST_TOKEN_HANDOFF_S", 30.0)  # no timeout within the test
    engine = ScriptedEngine()  # steps take microseconds: without the wait, many would run first
    loop = started(engine)
    steps_when_queued: list[int] = []

    class RecordingQueue(asyncio.Queue):
        def put_nowait(self, item) -> None:
            steps_when_queued.append(engine.steps)
            super().put_nowait(item)

    outbox = StreamOutbox(queue=RecordingQueue())
    loop.add(outbox, new_request("a", 300))
    items = await collect(outbox, {"a"})
    assert [o.num_output_tokens for o in items["a"]] == list(range(1, 301))
    assert steps_when_queued[0] == 1  # the first token reached the event loop before step 2 ran
    # (that later passes do not wait: test_steps_do_not_wait_for_the_event_loop)


def record_passes(loop: EngineLoop, engine: ScriptedEngine) -> list[tuple[int, list]]:
    """Each pass's handover as (engine steps so far, [(request_id, token_id or None, finish_reason)])."""
    passes: list[tuple[int, list]] = []
    put = loop._handover.put

    def recording_put(batch: list) -> None:
        passes.append((engine.steps, [(item[0], item[1].token_id, item[1].finish_reason)
                                      for outbox, item, ended in batch
                                      if outbox is not None and not isinstance(item, RequestFailure)]))
        put(batch)

    loop._handover.put = recording_put
    return passes


@contextlib.asynccontextmanager
async def recorded_loop(stream_interval: int = 1, step_s: float = 0.001):
    """A started EngineLoop over a ScriptedEngine: (loop, engine, its passes as record_passes
    records them); stopped after."""
    engine = ScriptedEngine(step_s=step_s)
    loop = EngineLoop(engine, stream_interval=stream_interval)
    loop.start()
    try:
        yield loop, engine, record_passes(loop, engine)
    finally:
        await loop.stop()


async def test_stream_interval_holds_plain_tokens_and_never_the_first_or_the_last():
    async with recorded_loop(stream_interval=4) as (loop, _, passes):
        outbox = StreamOutbox()
        loop.add(outbox, new_request("a", 10))
        items = (await collect(outbox, {"a"}))["a"]
    # Every token arrives once, in order, and the request ends as without the interval.
    assert [out.token_id for out in items] == list(range(1, 11))
    assert items[-1].finish_reason == FinishReason.LENGTH and not outbox.live
    # Token n came from step n: the first alone at once, then 2-5 handed over at step 5 and 6-9 at
    # step 9, and the last (10) at once, not held for the steps it would take to fill 4.
    assert [(steps, [token for _, token, _ in batch]) for steps, batch in passes] == [
        (1, [1]), (5, [2, 3, 4, 5]), (9, [6, 7, 8, 9]), (10, [10])]


async def test_stream_interval_releases_held_tokens_before_an_abort():
    async with recorded_loop(stream_interval=1000, step_s=0.002) as (loop, engine, _):
        outbox = StreamOutbox()
        loop.add(outbox, new_request("a", 100_000))
        await collect_first(outbox)
        while engine.steps < 5:
            await asyncio.sleep(0.005)
        assert outbox.queue.empty()  # steps 2.. are held
        loop.abort(outbox, "a")
        items = (await collect(outbox, {"a"}))["a"]
    # The held tokens, in order and none lost, then the abort.
    tokens = [out.token_id for out in items[:-1]]
    assert len(tokens) >= 4 and tokens == list(range(2, 2 + len(tokens)))
    assert items[-1].finish_reason == FinishReason.ABORT and items[-1].token_id is None
    assert not outbox.live


async def test_stream_interval_counts_steps_per_request():
    """A request that starts later is held on its own schedule; each gets every token once."""
    async with recorded_loop(stream_interval=3) as (loop, _, passes):
        outbox = StreamOutbox()
        loop.add(outbox, new_request("a", 12))
        first_of_a = (await asyncio.wait_for(outbox.queue.get(), 10))[1]
        loop.add(outbox, new_request("b", 7))
        items = await collect(outbox, {"a", "b"})
    items["a"].insert(0, first_of_a)
    assert len(items["a"]) == 12 and len(items["b"]) == 7
    for request_id in ("a", "b"):
        tokens = [out.token_id for out in items[request_id]]
        assert tokens == list(range(tokens[0], tokens[0] + len(tokens)))
        # Handed over: the first token, then every 3 steps (3 tokens each), then the rest with the end.
        sizes = [sum(1 for rid, _, _ in batch if rid == request_id) for _, batch in passes]
        sizes = [size for size in sizes if size]
        assert sizes[0] == 1 and all(size == 3 for size in sizes[1:-1]) and 1 <= sizes[-1] <= 3


def test_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineLoop(ScriptedEngine(), stream_interval=0)


async def test_a_request_may_ask_for_its_own_stream_interval():
    """AddRequest.stream_interval: 1 streams every step on a loop that holds (the gateway asks for
    it with stop strings); more than 1 holds on a loop that does not."""
    async with recorded_loop(stream_interval=4) as (loop, _, passes):
        outbox = StreamOutbox()
        every_step = new_request("every", 6)
        every_step.stream_interval = 1
        loop.add(outbox, every_step)
        await collect(outbox, {"every"})
    assert [[token for _, token, _ in batch] for _, batch in passes] == [[1], [2], [3], [4], [5], [6]]

    async with recorded_loop() as (loop, _, passes):
        outbox = StreamOutbox()
        held = new_request("held", 8)
        held.stream_interval = 3
        loop.add(outbox, held)
        items = (await collect(outbox, {"held"}))["held"]
    assert [out.token_id for out in items] == list(range(1, 9))
    assert [[token for _, token, _ in batch] for _, batch in passes] == [[1], [2, 3, 4], [5, 6, 7], [8]]
    assert not loop._interval_of and not loop._held  # nothing left of ended requests
