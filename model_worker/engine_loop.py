"""Drives the engine on its own thread, steps back to back: adds and aborts from every Generate
stream are queued by the event loop and applied by the engine thread between steps, so no engine
state needs a lock, and each step's outputs go back to the event loop without the next step
waiting for it (except, briefly, a step that gave some request its first token: see _flush).

Sits between the servicer (which owns gRPC streams) and the synchronous LLMEngine.

Why the engine thread runs the loop itself, and hands outputs over through a third thread:
when the event loop started each step, every step waited for the event loop to wake up, route
the outputs and submit the next step; and a thread that wakes the event loop (the socket write
of call_soon_threadsafe) then waits for the GIL while the event loop frames and sends. Either
way that gap sat between every two steps: 0.7 ms p50 at one stream (a 13 ms step) and 1.0 ms at
32 streams (a 40 ms step) through the gateway on 2 cores. With the handover thread it is 0.2 ms,
and the event loop frames step N's outputs while step N+1 computes (torch ops release the GIL).
One stream through the gateway with a core left for the serving path (--num-threads 1 on 2
cores, 3 alternating rounds): 66.7-67.5 tok/s against 61.1-64.0. With no core to spare (2 threads
on 2 cores) the framing's CPU comes out of the step instead, and the two measured the same.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import faulthandler
import itertools
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from model_worker.beam_search_request import BeamSearchRequest
from model_worker.engine import (
    GrammarWait,
    LLMEngine,
    RequestRejected,
    SequenceOutput,
    abort_outputs_unstarted,
)
from model_worker.sequence import FinishReason, SamplingParams
from model_worker.structured_output import CompiledGrammar, Constraint, GrammarCompiler, GrammarError

logger = logging.getLogger(__name__)


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    n: int = 1
    best_of: int = 0  # 0: n
    use_beam_search: bool = False  # beam width = best_of (or n)
    length_penalty: float = 1.0
    diversity_penalty: float = 0.0
    # Structured output: compiled by the loop (off the engine thread) before admission.
    constraint: Constraint | None = None
    grammar: CompiledGrammar | None = None  # set once constraint has compiled
    grammar_wait: GrammarWait | None = None  # the constraint starts later (after the thinking)
    stream_interval: int = 0  # AddRequest.stream_interval: 0 the loop's own, 1 every step
    cache_salt: str = ""  # AddRequest.cache_salt: shares prefix-cache blocks only with the same salt


@dataclass
class RequestFailure:
    """A request that ended without running: rejected at admission."""

    request_id: str
    code: grpc.StatusCode
    message: str
    field: str = ""  # the AddRequest field at fault (RequestError.field), if one
    # Set by EngineLoop.abort when the engine thread will deliver it: its stream counts it as
    # unanswered until then (StreamOutbox.unanswered).
    pending: bool = False


@dataclass(eq=False)  # identity: the servicer keeps the open ones in a set
class StreamOutbox:
    """Per-Generate-stream state: its live requests and the outputs waiting to be framed.
    Event loop only: the engine thread hands its items over through EngineLoop._deliver."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # request_id -> engine seq_id for requests of this stream that have not finished
    live: dict[str, int] = field(default_factory=dict)
    framing: bool = False  # items taken from the queue are being framed and sent (the servicer sets it)
    # Refusals on their way from the engine thread (EngineLoop.abort with a failure): the stream
    # stays open for them even once no request of it is live.
    unanswered: int = 0
    # Its client reads too slowly: from more than servicer.MAX_UNSENT_OUTPUTS outputs queued until
    # half of them have gone, its new adds are refused.
    backlogged: bool = False


# Longest a pass that produced first tokens waits for the event loop to send them (see
# EngineLoop._flush): long enough for a busy event loop to frame them, short enough that a
# stuck one costs the engine little.
FIRST_TOKEN_HANDOFF_S = 0.005

# One item for an outbox, made on the engine thread: (outbox, item for its queue, seq_id of a
# request that ended with it, or None). The event loop drops an ended request from outbox.live
# when it queues the item, so `live` and the queue never disagree on the event loop.
# (None, threading.Event, None) is the marker a first-token pass ends with (see EngineLoop._flush).
_Delivery = tuple["StreamOutbox | None", object, "tuple[str, int] | None"]


# How often, at most, the engine thread re-arms faulthandler's timer while steps run (see
# EngineLoop.arm_fault_timer): each arming starts a thread.
FAULT_TIMER_REARM_S = 1.0

ENGINE_THREAD_NAME = "engine-step"
# Passes failed in a row (each failing every request it had) after which the worker reports
# itself NOT_SERVING (EngineLoop.healthy): one bad request is gone after its one failure.
MAX_FAILED_STEPS_IN_A_ROW = 3


def name_os_thread(name: str) -> None:
    """The calling thread's name as Linux shows it (/proc/PID/task/TID/comm, 15 bytes at most),
    which threads it starts inherit; Python before 3.14 leaves it the process's. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME


def new_engine_thread() -> ThreadPoolExecutor:
    """The one thread that builds the engine and runs every step.

    libgomp keeps one OpenMP team per thread that starts parallel regions; once there are more
    team threads than CPUs (a model loaded on the main thread, then stepped on this one: 4
    threads on 2 cores at --num-threads 2), it spins only ~1000 times at each barrier before
    sleeping on a futex, so every torch op of a step pays a sleep and a wake-up. Building on the
    stepping thread keeps one team: SmolLM2 decode on 2 cores measured 1.5x (32 streams) and
    1.75x (1 stream) faster, at 2.0 instead of 1.2-1.4 cores busy (bench/bench_engine_thread.py).

    The OS knows it (and torch's OpenMP threads, which it starts) as ENGINE_THREAD_NAME, for
    `top -H` and for the check that it keeps the kernel's time slice (tokenwire/sched_slice.py).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=ENGINE_THREAD_NAME,
                              initializer=name_os_thread, initargs=(ENGINE_THREAD_NAME,))


class OutputHandover:
    """Engine thread -> event loop without the engine thread waking the event loop itself:
    put() only appends and sets an Event; this thread makes the call_soon_threadsafe, and so
    it, not the engine thread, waits for the GIL while the event loop runs. Batches keep their
    order (one deque, one thread)."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop, deliver: Callable[[list], None]) -> None:
        self._event_loop = event_loop
        self._deliver = deliver
        self._batches: collections.deque[list] = collections.deque()
        self._ready = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-outputs", daemon=True)
        self._thread.start()

    def put(self, batch: list) -> None:
        self._batches.append(batch)
        self._ready.set()

    def close(self) -> None:
        """Hands over what was put, then ends the thread (call while the event loop runs)."""
        self._closed = True
        self._ready.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._ready.wait()
            self._ready.clear()  # before draining: a put() after this sets it again
            batch: list = []
            while self._batches:
                batch.extend(self._batches.popleft())
            if batch:
                try:
                    self._event_loop.call_soon_threadsafe(self._deliver, batch)
                except RuntimeError:  # the event loop is closed: nobody is left to take them
                    return
            if self._closed and not self._batches:
                return


class EngineLoop:
    """Two sides. The event loop side (add, abort, abort_outputs, abort_all, structured output
    compiles, _deliver) owns the outboxes; the engine thread side (_run and what it calls) owns
    the engine, _owners and the beam searches. They meet only in the _pending_* lists (under
    _lock) and in the batches _flush hands to the event loop."""

    def __init__(self, engine: LLMEngine, grammar_compiler: GrammarCompiler | None = None,
                 executor: ThreadPoolExecutor | None = None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, not {stream_interval}")
        self.engine = engine
        # A request's plain tokens (neither its first nor its last) go out at most every
        # stream_interval steps (see _hold): SGLang's and vLLM's --stream-interval; a request may
        # ask for its own (NewRequest.stream_interval).
        self.stream_interval = stream_interval
        self._passes = 0  # engine thread: steps run so far
        # engine thread: seq_id -> its interval, for requests held at all (interval > 1)
        self._interval_of: dict[int, int] = {}
        # engine thread: seq_id -> (the pass by which its held items go out, the held items)
        self._held: dict[int, tuple[int, list[_Delivery]]] = {}
        self.grammar_compiler = grammar_compiler
        self._compiling: dict[int, tuple[StreamOutbox, NewRequest]] = {}  # by seq_id; event loop only
        # One thread: the engine is single-threaded, and torch uses its own pool inside. Pass the
        # executor the engine was built on (see new_engine_thread) so all torch work shares it.
        self.executor = executor or new_engine_thread()
        self._seq_ids = itertools.count()  # next() is atomic under the GIL; both sides draw ids
        self._owners: dict[int, tuple[StreamOutbox, str]] = {}
        self._lock = threading.Lock()  # guards the three _pending_* lists
        self._pending_adds: list[tuple[StreamOutbox, int, NewRequest]] = []
        # seq_id, the failure to end it with (None: a client's abort, ended FINISH_REASON_ABORT), and
        # its stream (where the failure goes even if the request has ended meanwhile)
        self._pending_aborts: list[tuple[int, RequestFailure | None, StreamOutbox]] = []
        # (seq_id, output indexes): aborts of some of a request's n outputs
        self._pending_output_aborts: list[tuple[int, set[int]]] = []
        self._beam_requests: dict[int, BeamSearchRequest] = {}  # by the request's seq_id
        self._beam_of_round: dict[int, BeamSearchRequest] = {}  # by the seq_id of a round's engine request
        self._wake = threading.Event()  # set when something is pending; the idle engine thread waits on it
        self._stopping = False
        self._deliveries: list[_Delivery] = []  # engine thread: this pass's items, not yet handed over
        self._first_tokens_in_pass = False  # engine thread: some request got its first token
        self._handover: OutputHandover | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread_done: asyncio.Future | None = None
        self._failed_steps_in_a_row = 0  # engine thread writes, anyone reads
        # engine thread writes, anyone reads: when the step now running began (time.monotonic()),
        # None between steps; and the thread's id, for its stack (see step_running_s)
        self._step_began: float | None = None
        self._engine_thread_id: int | None = None
        # faulthandler's exit for a step that holds the GIL for good (arm_fault_timer); 0: off
        self.fault_timeout_s = 0.0
        self._fault_armed_at: float | None = None  # engine thread only

    @property
    def healthy(self) -> bool:
        """False once MAX_FAILED_STEPS_IN_A_ROW passes in a row failed (each failing all its
        requests: a device lost, not one bad request, which its failure removes) or the engine
        thread ended before stop(): the worker can serve nothing, and says so (health NOT_SERVING),
        so that the gateway sends elsewhere and an orchestrator restarts it."""
        if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            return False
        return self._thread_done is None or not self._thread_done.done() or self._stopping

    @property
    def step_running_s(self) -> float:
        """How long the step now running has run (0 between steps). Torch releases the GIL in its
        ops, so a step stuck in one (a device that stopped answering, a kernel that never returns)
        leaves the event loop and health answering while no request moves: this is how the worker
        sees it (model_worker.__main__.watch_engine, --step-timeout-s)."""
        began = self._step_began
        return 0.0 if began is None else time.monotonic() - began

    def engine_thread_stack(self) -> str:
        """Where the engine thread is now, as traceback's lines: logged when a step hangs."""
        frame = sys._current_frames().get(self._engine_thread_id) if self._engine_thread_id is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(the engine thread is not running)"

    def arm_fault_timer(self, now: float) -> None:
        """Engine thread, before a step that begins now (time.monotonic()): a step stuck in a call that holds the GIL stops the event
        loop too, so nothing in Python (watch_engine) can see it; faulthandler's own C thread then
        prints every thread's stack and exits the process (status 1) fault_timeout_s after the last
        arming. Armed only while steps run (an idle worker paused for long, SIGSTOP or docker pause,
        is no hang), and re-armed at most every FAULT_TIMER_REARM_S: each arming starts a thread."""
        if self._fault_armed_at is None or now - self._fault_armed_at >= FAULT_TIMER_REARM_S:
            faulthandler.dump_traceback_later(self.fault_timeout_s, exit=True)
            self._fault_armed_at = now

    def disarm_fault_timer(self) -> None:
        if self._fault_armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._fault_armed_at = None

    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._handover = OutputHandover(self._event_loop, self._deliver)
        self._thread_done = self._event_loop.run_in_executor(self.executor, self._run)

    async def stop(self) -> None:
        with self._lock:  # see _run: the idle check reads _stopping under the same lock
            self._stopping = True
        self._wake.set()
        if self._thread_done is not None:
            try:
                await self._thread_done
            except Exception:
                logger.exception("the engine thread ended with an error")
        if self._handover is not None:
            await asyncio.to_thread(self._handover.close)
            await asyncio.sleep(0)  # run the last _deliver it scheduled
        self.executor.shutdown(wait=True)

    # --- event loop side ---

    def _queue_pending(self, pending: list, item) -> None:
        with self._lock:
            pending.append(item)
        self._wake.set()

    def add(self, outbox: StreamOutbox, request: NewRequest) -> None:
        seq_id = next(self._seq_ids)
        outbox.live[request.request_id] = seq_id
        if request.constraint is not None:
            self._compile_then_add(outbox, seq_id, request)
            return
        self._queue_pending(self._pending_adds, (outbox, seq_id, request))

    # Structured output: a constrained request waits for its grammar on the event loop side,
    # not in the engine.

    def _compile_then_add(self, outbox: StreamOutbox, seq_id: int, request: NewRequest) -> None:
        failure = None
        if self.grammar_compiler is None:
            failure = RequestFailure(request.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                     "structured output needs the model's tokenizer.json, which this worker does not "
                                     "have or could not read (see its start-up log)", "structured_output")
        elif request.use_beam_search:
            failure = RequestFailure(request.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                     "structured output cannot be combined with beam search", "structured_output")
        elif len(self._compiling) >= self.engine.max_waiting_requests:
            # Requests waiting for their grammars count against the waiting room too: the engine
            # counts a request only once it is added, and compiles (each up to seconds) queued without bound.
            failure = RequestFailure(request.request_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"{len(self._compiling)} requests are already waiting for their grammars to "
                                     "compile; try again later")
        if failure is not None:
            outbox.live.pop(request.request_id, None)
            outbox.queue.put_nowait(failure)
            return
        self._compiling[seq_id] = (outbox, request)
        future = self.grammar_compiler.submit(request.constraint)
        loop = asyncio.get_running_loop()
        # Runs on a compile thread (or here, on a cache hit); the rest happens on the event loop.
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._on_compiled, seq_id, done))

    def _on_compiled(self, seq_id: int, future: Future) -> None:
        entry = self._compiling.pop(seq_id, None)
        if entry is None:  # aborted while compiling; its abort output was sent
            return
        outbox, request = entry
        try:
            request.grammar = future.result()
        except Exception as exc:
            if isinstance(exc, GrammarError):  # the request's constraint is at fault
                failure = RequestFailure(request.request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                                         "structured_output")
            else:  # ours: no field, so no parameter is blamed
                logger.exception("compiling a structured output constraint failed")
                failure = RequestFailure(request.request_id, grpc.StatusCode.INTERNAL,
                                         "compiling the constraint failed; see the model worker's log")
            outbox.live.pop(request.request_id, None)
            outbox.queue.put_nowait(failure)
            return
        self._queue_pending(self._pending_adds, (outbox, seq_id, request))

    def _abort_compiling(self, seq_id: int, failure: RequestFailure | None) -> bool:
        entry = self._compiling.pop(seq_id, None)
        if entry is None:
            return False
        outbox, request = entry
        outbox.live.pop(request.request_id, None)
        if failure is not None:
            outbox.queue.put_nowait(failure)
            return True
        for out in abort_outputs_unstarted(seq_id, len(request.prompt_token_ids), request.n):
            outbox.queue.put_nowait((request.request_id, out))
        return True

    def abort(self, outbox: StreamOutbox, request_id: str, failure: RequestFailure | None = None) -> None:
        """Ends a live request: with FINISH_REASON_ABORT, or with `failure` as its last frame."""
        seq_id = outbox.live.get(request_id)
        if seq_id is not None and not self._abort_compiling(seq_id, failure):
            if failure is not None:
                failure.pending = True
                outbox.unanswered += 1
            self._queue_pending(self._pending_aborts, (seq_id, failure, outbox))

    def abort_outputs(self, outbox: StreamOutbox, request_id: str, indexes: set[int]) -> None:
        """Ends some of a request's n outputs (see AbortRequest.indexes); the others go on."""
        seq_id = outbox.live.get(request_id)
        if seq_id is not None:
            self._queue_pending(self._pending_output_aborts, (seq_id, indexes))

    def abort_all(self, outbox: StreamOutbox) -> None:
        for request_id in list(outbox.live):
            self.abort(outbox, request_id)

    def _deliver(self, deliveries: list[_Delivery]) -> None:
        """On the event loop: one engine pass's items, in the order the engine made them."""
        for outbox, item, ended in deliveries:
            if outbox is None:  # a first-token pass's marker (see _flush): set it once the
                # Generate tasks just woken by these items have run, i.e. framed and sent them
                asyncio.get_running_loop().call_soon(item.set)
                continue
            if ended is not None:
                request_id, seq_id = ended
                if outbox.live.get(request_id) == seq_id:
                    del outbox.live[request_id]
            if isinstance(item, RequestFailure) and item.pending:
                outbox.unanswered -= 1
            outbox.queue.put_nowait(item)

    # --- engine thread side ---

    def _emit(self, outbox: StreamOutbox, item, ended: tuple[str, int] | None = None) -> None:
        self._deliveries.append((outbox, item, ended))

    # --stream-interval: every item the event loop frames costs each hop after it (a frame entry, a
    # detok delta, an SSE event the client reads) about the same whatever the tokens it carries,
    # so holding a request's plain tokens for a few steps divides that cost. Its first token (TTFT)
    # and its end (and anything else: aborts, failures) never wait, and release what it holds first,
    # so its items keep their order.

    def _hold(self, seq_id: int, interval: int, delivery: _Delivery) -> None:
        held = self._held.get(seq_id)
        if held is None:
            self._held[seq_id] = (self._passes + interval - 1, [delivery])
        else:
            held[1].append(delivery)

    def _release(self, seq_id: int) -> None:
        held = self._held.pop(seq_id, None)
        if held is not None:
            self._deliveries.extend(held[1])

    def _release_due(self) -> None:
        """End of a pass: what has waited its request's interval in passes goes out (a preempted
        request's tokens too, whether or not it got more meanwhile)."""
        due = [seq_id for seq_id, (due_pass, _) in self._held.items() if due_pass <= self._passes]
        for seq_id in due:
            self._release(seq_id)

    def _flush(self) -> None:
        """Hands this pass's items to the event loop. A pass that produced some request's first
        token then waits (at most FIRST_TOKEN_HANDOFF_S) until the event loop has framed and sent
        them: otherwise the next step starts at once, and the event loop, needing the GIL that the
        engine thread's Python holds between torch ops, sent them 3.8-5.6 ms p50 after the step
        (one stream, scratch probe straight over gRPC) instead of 1.0-1.1 ms. Once per request,
        so its cost to throughput is one such wait per request, not per step."""
        if not self._deliveries:
            return
        deliveries, self._deliveries = self._deliveries, []
        taken = None
        if self._first_tokens_in_pass:
            self._first_tokens_in_pass = False
            taken = threading.Event()
            deliveries.append((None, taken, None))
        self._handover.put(deliveries)
        if taken is not None:
            taken.wait(FIRST_TOKEN_HANDOFF_S)

    def _apply_pending(self) -> None:
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
            output_aborts, self._pending_output_aborts = self._pending_output_aborts, []
        for outbox, seq_id, req in adds:
            try:
                if req.use_beam_search:
                    self._add_beam_search(outbox, seq_id, req)
                    continue
                self.engine.add_request(seq_id, req.prompt_token_ids, req.sampling, req.max_tokens,
                                        req.stop_token_ids, req.ignore_eos, req.n, req.best_of,
                                        grammar=req.grammar, grammar_wait=req.grammar_wait, cache_salt=req.cache_salt)
                self._owners[seq_id] = (outbox, req.request_id)
                interval = req.stream_interval or self.stream_interval
                if interval > 1:
                    self._interval_of[seq_id] = interval
            except RequestRejected as exc:
                self._emit(outbox, RequestFailure(req.request_id, exc.code, exc.message, exc.field), (req.request_id, seq_id))
            except Exception:  # a bug, not bad input: end this request only; the others go on
                logger.exception("adding request %s failed", req.request_id)
                self._owners.pop(seq_id, None)
                self._interval_of.pop(seq_id, None)
                try:
                    self.engine.abort_request(seq_id)  # in case it got half in
                except Exception:
                    logger.exception("aborting request %s after its failed add", req.request_id)
                self._emit(outbox, RequestFailure(req.request_id, grpc.StatusCode.INTERNAL,
                                                  "adding the request failed; see the model worker's log"),
                           (req.request_id, seq_id))
        for seq_id, failure, failure_outbox in aborts:
            owner = self._owners.pop(seq_id, None)
            if owner is None:  # already finished (or refused at admission), or aborted twice
                if failure is not None:
                    # The add this failure refuses still gets its answer, after the ended
                    # request's own last frame.
                    self._emit(failure_outbox, failure)
                continue
            outbox, request_id = owner
            self._release(seq_id)
            self._interval_of.pop(seq_id, None)
            outputs: list[SequenceOutput] | None = None
            try:
                beam_request = self._beam_requests.pop(seq_id, None)
                if beam_request is not None:
                    for round_seq_id in beam_request.in_flight:
                        self._beam_of_round.pop(round_seq_id, None)
                    outputs = beam_request.abort()
                else:
                    outputs = self.engine.abort_request(seq_id)
            except Exception:  # a bug: this request still gets its last item, and the others go on
                logger.exception("aborting request %s failed", request_id)
            if failure is not None:
                self._emit(outbox, failure, (request_id, seq_id))
                continue
            if outputs is None:
                self._emit(outbox, RequestFailure(request_id, grpc.StatusCode.INTERNAL,
                                                  "aborting the request failed; see the model worker's log"),
                           (request_id, seq_id))
                continue
            for out in outputs:
                self._emit(outbox, (request_id, out), (request_id, seq_id))
        for seq_id, indexes in output_aborts:
            # not already ended by a whole-request abort; beam searches have no per-output aborts
            if seq_id in self._owners and seq_id not in self._beam_requests:
                self._route(self.engine.abort_outputs(seq_id, indexes))

    def _add_beam_search(self, outbox: StreamOutbox, seq_id: int, req: NewRequest) -> None:
        try:
            beam_request = BeamSearchRequest(
                self.engine, lambda: next(self._seq_ids), seq_id, req.prompt_token_ids, req.sampling,
                req.max_tokens, req.stop_token_ids, req.ignore_eos, req.n, req.best_of, req.length_penalty,
                req.diversity_penalty, cache_salt=req.cache_salt)
            beam_request.start()
        except RequestRejected as exc:
            self._emit(outbox, RequestFailure(req.request_id, exc.code, exc.message, exc.field), (req.request_id, seq_id))
            return
        self._owners[seq_id] = (outbox, req.request_id)
        self._beam_requests[seq_id] = beam_request
        self._beam_of_round.update(dict.fromkeys(beam_request.in_flight, beam_request))

    def _route_beam_round(self, out: SequenceOutput) -> None:
        beam_request = self._beam_of_round.pop(out.seq_id)
        request_seq_id = beam_request.request_seq_id
        outbox, request_id = self._owners[request_seq_id]
        try:
            outputs = beam_request.on_output(out)
        except Exception as exc:  # RequestRejected, or a bug in this search: the step's others go on
            if not isinstance(exc, RequestRejected):
                logger.exception("beam search %s failed", request_id)
                exc = RequestRejected(grpc.StatusCode.INTERNAL, f"beam search failed: {exc!r}")
            for round_seq_id in beam_request.in_flight:
                self._beam_of_round.pop(round_seq_id, None)
            beam_request.abort()
            outputs, failure = None, RequestFailure(request_id, exc.code, exc.message)
        else:
            failure = None
            self._beam_of_round.update(dict.fromkeys(beam_request.in_flight, beam_request))
        if outputs is None and failure is None:
            return
        del self._owners[request_seq_id]
        del self._beam_requests[request_seq_id]
        ended = (request_id, request_seq_id)
        if failure is not None:
            self._emit(outbox, failure, ended)
            return
        for final in outputs:
            self._emit(outbox, (request_id, final), ended)

    def _route(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            if out.seq_id in self._beam_of_round:
                self._route_beam_round(out)
                continue
            owner = self._owners.get(out.seq_id)
            if owner is None:  # aborted while the step ran; its abort output was sent
                continue
            outbox, request_id = owner
            interval = self._interval_of.get(out.seq_id) if self._interval_of else None
            if (interval is not None and out.token_id is not None and out.num_output_tokens > 1
                    and out.finish_reason == FinishReason.NONE and out.error is None
                    and out.prompt_logprobs is None):
                self._hold(out.seq_id, interval, (outbox, (request_id, out), None))
                continue
            if self._held:
                self._release(out.seq_id)
            ended = None
            if out.request_finished:
                del self._owners[out.seq_id]
                self._interval_of.pop(out.seq_id, None)
                ended = (request_id, out.seq_id)
            if out.num_output_tokens == 1 and out.token_id is not None:
                self._first_tokens_in_pass = True
            self._emit(outbox, (request_id, out), ended)

    def _run(self) -> None:
        """The engine thread, until stop(): apply what is pending, step, hand the outputs over
        (without waiting for the event loop to take them), again; sleep while there is no work."""
        self._engine_thread_id = threading.get_ident()
        try:
            self._steps_until_stopped()
        finally:
            self.disarm_fault_timer()

    def _steps_until_stopped(self) -> None:
        while not self._stopping:
            try:
                self._apply_pending()
                if self.engine.has_work():
                    self._step_began = now = time.monotonic()
                    if self.fault_timeout_s:
                        self.arm_fault_timer(now)
                    try:
                        outputs = self.engine.step()
                    finally:
                        self._step_began = None
                    self._passes += 1
                    self._route(outputs)
                    self._failed_steps_in_a_row = 0
                    if self._held:
                        self._release_due()
            except Exception:
                self._failed_steps_in_a_row += 1
                logger.exception("engine step failed (%d in a row); failing its requests",
                                 self._failed_steps_in_a_row)
                try:
                    self._fail_all("engine step failed; see the model worker's log")
                except Exception:  # the thread must live on: a dead one hangs every later request
                    logger.exception("failing the requests of a failed step failed")
            self._flush()
            if not self.engine.has_work():
                with self._lock:
                    if self._stopping or self._pending_adds or self._pending_aborts or self._pending_output_aborts:
                        continue
                    self._wake.clear()  # under the lock: a later _queue_pending or stop() sets it again
                self.disarm_fault_timer()
                while not self._wake.wait(1.0):
                    if self._event_loop.is_closed():  # its owner ended without stop(): let the process exit
                        return

    def _fail_all(self, message: str) -> None:
        for seq_id, (outbox, request_id) in list(self._owners.items()):
            self._release(seq_id)
            try:
                self.engine.abort_request(seq_id)
            except Exception:  # the failure may have left it half-added; free what can be freed
                logger.exception("aborting request %s after a failed step", request_id)
            self._emit(outbox, RequestFailure(request_id, grpc.StatusCode.INTERNAL, message), (request_id, seq_id))
        self._owners.clear()
        self._interval_of.clear()
        for beam_request in self._beam_requests.values():
            beam_request.abort()
        self._beam_requests.clear()
        self._beam_of_round.clear()
