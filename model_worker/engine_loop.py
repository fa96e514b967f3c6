"""Drives the engine from asyncio: steps run in one named executor thread, and adds/aborts
from every Generate stream are applied between steps, so no engine state needs a lock.

Sits between the servicer (which owns gRPC streams) and the synchronous LLMEngine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from model_worker.beam_search_request import BeamSearchRequest
from model_worker.engine import LLMEngine, RequestRejected, SequenceOutput
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


@dataclass
class RequestFailure:
    """A request that ended without running: rejected at admission."""

    request_id: str
    code: grpc.StatusCode
    message: str


@dataclass
class StreamOutbox:
    """Per-Generate-stream state: its live requests and the outputs waiting to be framed."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # request_id -> engine seq_id for requests of this stream that have not finished
    live: dict[str, int] = field(default_factory=dict)


def new_engine_thread() -> ThreadPoolExecutor:
    """The one thread that builds the engine and runs every step.

    libgomp keeps one OpenMP team per thread that starts parallel regions; once there are more
    team threads than CPUs (a model loaded on the main thread, then stepped on this one: 4
    threads on 2 cores at --num-threads 2), it spins only ~1000 times at each barrier before
    sleeping on a futex, so every torch op of a step pays a sleep and a wake-up. Building on the
    stepping thread keeps one team: SmolLM2 decode on 2 cores measured 1.5x (32 streams) and
    1.75x (1 stream) faster, at 2.0 instead of 1.2-1.4 cores busy (bench/bench_engine_thread.py).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")


class EngineLoop:
    def __init__(self, engine: LLMEngine, grammar_compiler: GrammarCompiler | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self.grammar_compiler = grammar_compiler
        self._compiling: dict[int, tuple[StreamOutbox, NewRequest]] = {}  # by seq_id
        # One thread: the engine is single-threaded, and torch uses its own pool inside. Pass the
        # executor the engine was built on (see new_engine_thread) so all torch work shares it.
        self.executor = executor or new_engine_thread()
        self._seq_ids = itertools.count()
        self._owners: dict[int, tuple[StreamOutbox, str]] = {}
        self._pending_adds: list[tuple[StreamOutbox, int, NewRequest]] = []
        self._pending_aborts: list[int] = []
        # (seq_id, output indexes): aborts of some of a request's n outputs
        self._pending_output_aborts: list[tuple[int, set[int]]] = []
        self._beam_requests: dict[int, BeamSearchRequest] = {}  # by the request's seq_id
        self._beam_of_round: dict[int, BeamSearchRequest] = {}  # by the seq_id of a round's engine request
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=True)

    def add(self, outbox: StreamOutbox, request: NewRequest) -> None:
        seq_id = next(self._seq_ids)
        outbox.live[request.request_id] = seq_id
        if request.constraint is not None:
            self._compile_then_add(outbox, seq_id, request)
            return
        self._pending_adds.append((outbox, seq_id, request))
        self._wake.set()

    # --- structured output: a constrained request waits for its grammar, not the engine ---

    def _compile_then_add(self, outbox: StreamOutbox, seq_id: int, request: NewRequest) -> None:
        problem = None
        if self.grammar_compiler is None:
            problem = "structured output needs the model's tokenizer.json, which this worker does not have"
        elif request.use_beam_search:
            problem = "structured output cannot be combined with beam search"
        if problem is not None:
            outbox.live.pop(request.request_id, None)
            outbox.queue.put_nowait(RequestFailure(request.request_id, grpc.StatusCode.INVALID_ARGUMENT, problem))
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
            if isinstance(exc, GrammarError):
                code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
            else:
                logger.exception("compiling a structured output constraint failed")
                code, message = grpc.StatusCode.INTERNAL, "compiling the constraint failed; see the model worker's log"
            outbox.live.pop(request.request_id, None)
            outbox.queue.put_nowait(RequestFailure(request.request_id, code, message))
            return
        self._pending_adds.append((outbox, seq_id, request))
        self._wake.set()

    def _abort_compiling(self, seq_id: int) -> bool:
        entry = self._compiling.pop(seq_id, None)
        if entry is None:
            return False
        outbox, request = entry
        outbox.live.pop(request.request_id, None)
        outbox.queue.put_nowait((request.request_id, SequenceOutput(
            seq_id, None, finish_reason=FinishReason.ABORT, request_finished=True)))
        return True

    # --- end of structured output ---

    def abort(self, outbox: StreamOutbox, request_id: str) -> None:
        seq_id = outbox.live.get(request_id)
        if seq_id is not None:
            self._pending_aborts.append(seq_id)
            self._wake.set()

    def abort_outputs(self, outbox: StreamOutbox, request_id: str, indexes: set[int]) -> None:
        """Ends some of a request's n outputs (see AbortRequest.indexes); the others go on."""
        seq_id = outbox.live.get(request_id)
        if seq_id is not None and seq_id not in self._beam_requests:
            self._pending_output_aborts.append((seq_id, indexes))
            self._wake.set()

    def abort_all(self, outbox: StreamOutbox) -> None:
        for request_id in list(outbox.live):
            self.abort(outbox, request_id)

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for outbox, seq_id, req in adds:
            if req.use_beam_search:
                self._add_beam_search(outbox, seq_id, req)
                continue
            try:
                self.engine.add_request(seq_id, req.prompt_token_ids, req.sampling, req.max_tokens,
                                        req.stop_token_ids, req.ignore_eos, req.n, req.best_of,
                                        grammar=req.grammar)
                self._owners[seq_id] = (outbox, req.request_id)
            except RequestRejected as exc:
                outbox.live.pop(req.request_id, None)
                outbox.queue.put_nowait(RequestFailure(req.request_id, exc.code, exc.message))
        aborts, self._pending_aborts = self._pending_aborts, []
        for seq_id in aborts:
            if self._abort_compiling(seq_id):
                continue
            owner = self._owners.pop(seq_id, None)
            if owner is None:
                continue
            outbox, request_id = owner
            outbox.live.pop(request_id, None)
            beam_request = self._beam_requests.pop(seq_id, None)
            if beam_request is not None:
                for round_seq_id in beam_request.in_flight:
                    self._beam_of_round.pop(round_seq_id, None)
                outputs = beam_request.abort()
            else:
                outputs = self.engine.abort_request(seq_id)
            for out in outputs:
                outbox.queue.put_nowait((request_id, out))
        output_aborts, self._pending_output_aborts = self._pending_output_aborts, []
        for seq_id, indexes in output_aborts:
            if seq_id in self._owners:  # not already ended by a whole-request abort
                self._route(self.engine.abort_outputs(seq_id, indexes))

    def _add_beam_search(self, outbox: StreamOutbox, seq_id: int, req: NewRequest) -> None:
        try:
            beam_request = BeamSearchRequest(
                self.engine, lambda: next(self._seq_ids), seq_id, req.prompt_token_ids, req.sampling,
                req.max_tokens, req.stop_token_ids, req.ignore_eos, req.n, req.best_of, req.length_penalty,
                req.diversity_penalty)
            beam_request.start()
        except RequestRejected as exc:
            outbox.live.pop(req.request_id, None)
            outbox.queue.put_nowait(RequestFailure(req.request_id, exc.code, exc.message))
            return
        self._owners[seq_id] = (outbox, req.request_id)
        self._beam_requests[seq_id] = beam_request
        self._beam_of_round.update(dict.fromkeys(beam_request.in_flight, beam_request))

    def _route_beam_round(self, out: SequenceOutput) -> None:
        beam_request = self._beam_of_round.pop(out.seq_id)
        outbox, request_id = self._owners[beam_request.request_seq_id]
        try:
            outputs = beam_request.on_output(out)
        except RequestRejected as exc:
            for round_seq_id in beam_request.in_flight:
                self._beam_of_round.pop(round_seq_id, None)
            beam_request.abort()
            outputs, failure = None, RequestFailure(request_id, exc.code, exc.message)
        else:
            failure = None
            self._beam_of_round.update(dict.fromkeys(beam_request.in_flight, beam_request))
        if outputs is None and failure is None:
            return
        del self._owners[beam_request.request_seq_id]
        del self._beam_requests[beam_request.request_seq_id]
        outbox.live.pop(request_id, None)
        if failure is not None:
            outbox.queue.put_nowait(failure)
            return
        for final in outputs:
            outbox.queue.put_nowait((request_id, final))

    def _route(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            if out.seq_id in self._beam_of_round:
                self._route_beam_round(out)
                continue
            owner = self._owners.get(out.seq_id)
            if owner is None:  # aborted while the step ran; its abort output was sent
                continue
            outbox, request_id = owner
            if out.request_finished:
                del self._owners[out.seq_id]
                outbox.live.pop(request_id, None)
            outbox.queue.put_nowait((request_id, out))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_work():
                self._wake.clear()
                if self._pending_adds or self._pending_aborts or self._pending_output_aborts:
                    continue
                await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self.executor, self.engine.step)
            except Exception:
                logger.exception("engine step failed; failing its requests")
                self._fail_all("engine step failed; see the model worker's log")
                continue
            self._route(outputs)

    def _fail_all(self, message: str) -> None:
        for seq_id, (outbox, request_id) in list(self._owners.items()):
            self.engine.abort_request(seq_id)
            outbox.live.pop(request_id, None)
            outbox.queue.put_nowait(RequestFailure(request_id, grpc.StatusCode.INTERNAL, message))
        self._owners.clear()
        for beam_request in self._beam_requests.values():
            beam_request.abort()
        self._beam_requests.clear()
        self._beam_of_round.clear()
