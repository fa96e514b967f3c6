"""A step that never returns (--step-timeout-s): torch releases the GIL inside its ops, so a stuck
one leaves gRPC and health answering while no request moves. The worker must see it, say
NOT_SERVING, end its Generate calls with UNAVAILABLE and the reason, and exit to be restarted."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2

from model_worker import __main__ as model_worker_main
from model_worker.engine_loop import EngineLoop, StreamOutbox
from model_worker.servicer import ModelWorkerServicer
from tests.test_engine_loop import ScriptedEngine, collect, collect_first, new_request
from tokenwire.stack import ServiceProcess, free_port, wait_grpc_serving
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent


class HangingEngine(ScriptedEngine):
    """A ScriptedEngine whose step number hang_at waits (GIL released) until released."""

    def __init__(self, hang_at: int) -> None:
        super().__init__()
        self.hang_at = hang_at
        self.release = threading.Event()
        self.hanging = threading.Event()

    def step(self):
        if self.steps + 1 == self.hang_at:
            self.hanging.set()
            self.release.wait()
        return super().step()


class FaultTimer:
    """Stands in for faulthandler's timer in this process (a real one would end pytest's run):
    records each arming and cancel."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed: list[float] = []
        self.cancelled = 0
        self.on = False
        monkeypatch.setattr(faulthandler, "dump_traceback_later", self.arm)
        monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", self.cancel)

    def arm(self, timeout: float, repeat: bool = False, file=None, exit: bool = False) -> None:
        assert exit and not repeat
        self.armed.append(timeout)
        self.on = True

    def cancel(self) -> None:
        self.cancelled += 1
        self.on = False


async def test_a_step_that_runs_past_the_timeout_is_reported_hung_with_the_engine_threads_stack(monkeypatch):
    timer = FaultTimer(monkeypatch)
    engine = HangingEngine(hang_at=3)
    loop = EngineLoop(engine)
    loop.fault_timeout_s = 7.0
    loop.start()
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        assert loop.step_running_s == 0.0
        outbox = StreamOutbox()
        loop.add(outbox, new_request("r", 100))
        watcher = asyncio.create_task(model_worker_main.watch_engine(loop, health_servicer, 0.3, poll_s=0.01))
        assert await asyncio.to_thread(engine.hanging.wait, 10)
        await asyncio.sleep(0.1)
        assert not watcher.done()  # running, not yet past the timeout
        assert 0.05 < loop.step_running_s < 0.3
        stack = loop.engine_thread_stack()
        assert "in step" in stack and "release.wait()" in stack, stack
        why = await asyncio.wait_for(watcher, 5)
        assert why is not None and "hung" in why and "--step-timeout-s 0.3" in why, why
        request = health_pb2.HealthCheckRequest(service="")
        assert (await health_servicer.Check(request, None)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        # faulthandler's exit (a step holding the GIL) was armed by the first step, not again
        # within the second, and stays armed through the hung step
        assert timer.armed == [7.0] and timer.on
    finally:
        engine.release.set()
        await loop.stop()
    assert not timer.on  # off once the engine thread ended


async def test_the_fault_timer_is_off_while_the_engine_is_idle(monkeypatch):
    """A worker paused (SIGSTOP, docker pause) for longer than the timer while idle is no hang."""
    timer = FaultTimer(monkeypatch)
    loop = EngineLoop(ScriptedEngine(step_s=0.01))
    loop.fault_timeout_s = 7.0
    loop.start()
    try:
        await asyncio.sleep(0.05)
        assert timer.armed == []
        outbox = StreamOutbox()
        loop.add(outbox, new_request("r", 3))
        await collect(outbox, {"r"})
        for _ in range(100):  # the engine thread goes idle right after the last step
            if not timer.on:
                break
            await asyncio.sleep(0.01)
        assert timer.armed == [7.0] and not timer.on and timer.cancelled == 1
    finally:
        await loop.stop()


async def test_steps_shorter_than_the_timeout_and_a_timeout_of_zero_never_report_a_hang():
    engine = ScriptedEngine(step_s=0.02)
    loop = EngineLoop(engine)
    loop.start()
    health_servicer = health.aio.HealthServicer()
    try:
        outbox = StreamOutbox()
        loop.add(outbox, new_request("r", 30))
        watchers = [asyncio.create_task(model_worker_main.watch_engine(loop, health_servicer, timeout, poll_s=0.005))
                    for timeout in (0.2, 0.0)]
        await collect_first(outbox)
        await asyncio.sleep(0.5)  # 25 steps of 20 ms
        assert engine.steps >= 10 and not any(w.done() for w in watchers)
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await loop.stop()


async def test_a_step_that_hangs_while_the_worker_stops_still_ends_the_process(monkeypatch):
    """A SIGTERM's drain ends, then loop.stop() waits for the step running: one that hangs there
    would hold the process for good, past any drain grace."""
    engine = HangingEngine(hang_at=2)
    exits: list[int] = []

    def exit_process(status: int) -> None:
        exits.append(status)
        engine.release.set()  # lets this test's loop.stop() end

    monkeypatch.setattr(model_worker_main, "exit_process", exit_process)
    loop = EngineLoop(engine)
    loop.start()
    loop.add(StreamOutbox(), new_request("r", 100))
    assert await asyncio.to_thread(engine.hanging.wait, 10)
    watcher = asyncio.create_task(model_worker_main.watch_engine(loop, health.aio.HealthServicer(), 0.3, poll_s=0.01))
    await asyncio.wait_for(model_worker_main.stop_engine(loop, watcher), 10)
    assert exits == [model_worker_main.HUNG_EXIT_STATUS]


class AbortingContext:
    """grpc.aio's ServicerContext.abort, as far as Generate uses it: records, then raises."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


async def test_fail_streams_ends_each_generate_call_with_the_status_after_its_queued_frames():
    engine = HangingEngine(hang_at=3)
    loop = EngineLoop(engine)
    loop.start()
    servicer = ModelWorkerServicer(loop, pb.ModelInfo())
    client_open = asyncio.Event()

    async def requests():
        yield pb.RequestFrame(adds=[pb.AddRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=50)])
        await client_open.wait()

    context = AbortingContext()
    tokens = 0
    try:
        call = servicer.Generate(requests(), context)
        first = await asyncio.wait_for(anext(call), 10)
        tokens += sum(len(seq.token_ids) // 4 for seq in first.sequences)
        assert await asyncio.to_thread(engine.hanging.wait, 10)
        assert servicer.open_streams == 1
        (outbox,) = servicer._streams
        for _ in range(500):  # the second step's output, on its way through the handover thread
            if tokens + outbox.queue.qsize() >= 2:
                break
            await asyncio.sleep(0.01)
        servicer.fail_streams(grpc.StatusCode.UNAVAILABLE, "the step is hung")
        with pytest.raises(grpc.aio.AbortError):
            async for frame in call:
                tokens += sum(len(seq.token_ids) // 4 for seq in frame.sequences)
        assert context.aborted == (grpc.StatusCode.UNAVAILABLE, "the step is hung")
        assert tokens == 2  # the two steps before the hung one, framed before the end
        assert servicer.open_streams == 0
    finally:
        engine.release.set()
        await loop.stop()


# Runs the real model worker with LLMEngine.step patched: once a request with HANG_PROMPT has been
# added, its fourth step never returns. Two ways: waiting on an Event with the GIL released (as a
# torch op stuck on a device), or in a regular expression's exponential backtracking, which holds
# the GIL (as a C call that never lets go of it): then the event loop stops too.
HANG_PROMPT = [1, 2, 3, 4, 5]
HANGS = {"gil_released": "threading.Event().wait()", "gil_held": "re.match(r'(a+)+$', 'a' * 64 + 'b')"}
HANGING_WORKER = """
import re, sys, threading
from model_worker import engine as engine_module
from model_worker.__main__ import main

real_add, real_step = engine_module.LLMEngine.add_request, engine_module.LLMEngine.step
steps_of_marked = []

def add_request(self, seq_id, prompt_token_ids, *args, **kwargs):
    if list(prompt_token_ids) == HANG_PROMPT:
        steps_of_marked.append(0)
    return real_add(self, seq_id, prompt_token_ids, *args, **kwargs)

def step(self):
    if steps_of_marked:
        steps_of_marked[0] += 1
        if steps_of_marked[0] == 4:
            HANG
    return real_step(self)

engine_module.LLMEngine.add_request, engine_module.LLMEngine.step = add_request, step
sys.argv = ["model_worker", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("hang", list(HANGS))
def test_a_model_worker_whose_step_hangs_fails_its_streams_and_exits(
        hang: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "model_worker.log"
    log_file = log_path.open("w")
    script = HANGING_WORKER.replace("HANG_PROMPT", repr(HANG_PROMPT)).replace("HANG", HANGS[hang])
    process = subprocess.Popen(
        [sys.executable, "-c", script, "--port", str(port), "--model", str(tiny_model_dir),
         "--load-format", "dummy", "--num-threads", "1", "--device", "cpu", "--step-timeout-s", "1"],
        cwd=REPO_ROOT, stderr=log_file)
    address = f"127.0.0.1:{port}"
    try:
        wait_grpc_serving(ServiceProcess("model_worker", [], process), address, 120)
        with grpc.insecure_channel(address) as channel:
            stub = model_worker_pb2_grpc.ModelWorkerStub(channel)
            ok = pb.AddRequest(request_id="ok", prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
            ok_done = [seq for frame in stub.Generate(iter([pb.RequestFrame(adds=[ok])]))
                       for seq in frame.sequences if seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
            assert [seq.finish_reason for seq in ok_done] == [pb.FINISH_REASON_LENGTH]

            frames_open = threading.Event()

            def requests():
                yield pb.RequestFrame(adds=[pb.AddRequest(request_id="hangs", prompt_token_ids=HANG_PROMPT,
                                                          max_tokens=100, ignore_eos=True)])
                frames_open.wait(60)  # the client keeps its side open

            tokens = 0
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                for frame in stub.Generate(requests(), timeout=60):
                    tokens += sum(len(seq.token_ids) // 4 for seq in frame.sequences)
            failed_after = time.monotonic() - started
            frames_open.set()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        # the three steps before the hung one; with the GIL held, the last may not have gone out
        assert tokens == 3 if hang == "gil_released" else 1 <= tokens <= 3, tokens
        # 1 s of timeout, then up to 1 s until the watcher's next look (the GIL released) or 5 s
        # more for faulthandler's timer (held); not the client's 60 s
        assert failed_after < 15, failed_after
        assert process.wait(30) == model_worker_main.HUNG_EXIT_STATUS
        log = log_path.read_text()
        if hang == "gil_released":  # the event loop saw it: the reason, and the engine thread's stack
            assert "has not returned" in failed.value.details() and "hung" in failed.value.details(), failed.value
            assert "the engine thread is at" in log and ", in step\n" in log and "in _run\n" in log, log[-3000:]
        else:  # faulthandler's thread: every thread's stack, the engine thread's in step
            assert "Timeout (0:00:06)!" in log and 'line 18 in step\n' in log, log[-3000:]
        print(f"\n[figure] a hung step ({hang}, --step-timeout-s 1): its stream ended UNAVAILABLE "
              f"{failed_after:.2f}s after the request was sent; the worker exited with status 1")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log_file.close()


@pytest.mark.slow
def test_a_step_that_hangs_through_a_sigterm_drain_still_ends_the_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while a step hangs: the drain's grace (1 s) runs out with its call open, then the
    engine's stop waits on the step. Before, the watcher was cancelled first and the worker never
    exited; and the drain's two stops cancelling calls at once crashed grpc.aio (SIGSEGV)."""
    port = free_port()
    log_path = tmp_path / "model_worker.log"
    script = HANGING_WORKER.replace("HANG_PROMPT", repr(HANG_PROMPT)).replace("HANG", HANGS["gil_released"])
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", script, "--port", str(port), "--model", str(tiny_model_dir), "--load-format",
             "dummy", "--num-threads", "1", "--device", "cpu", "--step-timeout-s", "4", "--drain-grace-s", "1"],
            cwd=REPO_ROOT, stderr=log_file)
    address = f"127.0.0.1:{port}"
    frames_open = threading.Event()
    try:
        wait_grpc_serving(ServiceProcess("model_worker", [], process), address, 120)
        with grpc.insecure_channel(address) as channel:
            stub = model_worker_pb2_grpc.ModelWorkerStub(channel)

            def requests():
                yield pb.RequestFrame(adds=[pb.AddRequest(request_id="hangs", prompt_token_ids=HANG_PROMPT,
                                                          max_tokens=100, ignore_eos=True)])
                frames_open.wait(60)

            first_frame = threading.Event()
            ended: list[grpc.StatusCode] = []

            def read() -> None:  # the gateway's reader: a read waits on the call throughout
                try:
                    for _ in stub.Generate(requests(), timeout=60):
                        first_frame.set()
                except grpc.RpcError as exc:
                    ended.append(exc.code())

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            assert first_frame.wait(30)  # its first token: the step that hangs is three steps on
            time.sleep(0.5)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = process.wait(30)
            exited_s = time.monotonic() - signalled
            reader.join(10)
            assert ended == [grpc.StatusCode.UNAVAILABLE]  # the drain's end cancelled it
    finally:
        frames_open.set()
        if process.poll() is None:
            process.kill()
            process.wait()
    log = log_path.read_text()
    assert code == model_worker_main.HUNG_EXIT_STATUS, (code, log[-3000:])
    assert "draining (grace 1.0s)" in log and "taken as hung" in log, log[-3000:]
    assert 3 < exited_s < 10, exited_s
