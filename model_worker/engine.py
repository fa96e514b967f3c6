"""The engine: validates requests, runs one scheduled step, and reports what each sequence got.

Synchronous and single-threaded by design; the servicer's asyncio loop calls step() in one
named executor thread and applies adds/aborts only between steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from model_worker.kv_cache import SlotAllocator
from model_worker.model_runner import ModelRunner
from model_worker.sampler import SamplerOutput, SamplingBatch, SeededGenerators, sample
from model_worker.scheduler import Scheduler
from model_worker.sequence import FinishReason, SamplingParams, Sequence

logger = logging.getLogger(__name__)


class RequestRejected(Exception):
    """A request the engine will not run; carries the gRPC status code to report."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class SequenceOutput:
    """What one sequence got from one step (at most one new token)."""

    seq_id: int
    token_id: int | None
    logprob: float | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    stop_token_id: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


class LLMEngine:
    def __init__(self, runner: ModelRunner, eos_token_ids: list[int], max_num_seqs: int,
                 max_num_batched_tokens: int, max_waiting_requests: int, seed: int = 0) -> None:
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = runner.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.scheduler = Scheduler(SlotAllocator(max_num_seqs), max_num_batched_tokens)
        self.generators = SeededGenerators(runner.device, seed)
        self.sequences: dict[int, Sequence] = {}

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add_request(self, seq_id: int, prompt_token_ids: list[int], sampling: SamplingParams, max_tokens: int,
                    stop_token_ids: list[int], ignore_eos: bool) -> Sequence:
        """Validates and queues a request; raises RequestRejected with a clear message."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        vocab = self.runner.vocab_size
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestRejected(invalid, "prompt_token_ids is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(invalid, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        bad_stop = [t for t in stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise RequestRejected(invalid, f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab})")
        if num_prompt >= self.max_model_len:
            raise RequestRejected(invalid, f"the prompt has {num_prompt} tokens, but the model's context is "
                                           f"{self.max_model_len} tokens, which leaves no room for output")
        if max_tokens < 0:
            raise RequestRejected(invalid, f"max_tokens must be >= 0 (0 means up to the context), not {max_tokens}")
        if max_tokens and num_prompt + max_tokens > self.max_model_len:
            raise RequestRejected(invalid, f"this model's maximum context length is {self.max_model_len} tokens, "
                                           f"but {num_prompt + max_tokens} were requested ({num_prompt} in the "
                                           f"prompt, {max_tokens} for the output)")
        if sampling.temperature < 0 or sampling.temperature != sampling.temperature:
            raise RequestRejected(invalid, f"temperature must be >= 0, not {sampling.temperature}")
        if not 0.0 <= sampling.top_p <= 1.0:
            raise RequestRejected(invalid, f"top_p must be in (0, 1], not {sampling.top_p}")
        if sampling.top_k < 0:
            raise RequestRejected(invalid, f"top_k must be >= 0 (0 disables it), not {sampling.top_k}")
        if not 0 <= sampling.top_logprobs <= vocab:
            raise RequestRejected(invalid, f"top_logprobs must be in [0, {vocab}], not {sampling.top_logprobs}")
        if len(self.scheduler.waiting) >= self.max_waiting_requests:
            raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"{len(self.scheduler.waiting)} requests are already waiting; try again later")
        if seq_id in self.sequences:
            raise RequestRejected(grpc.StatusCode.ALREADY_EXISTS, f"sequence {seq_id} already exists")
        stops = set(stop_token_ids)
        if not ignore_eos:
            stops |= self.eos_token_ids
        seq = Sequence(
            seq_id=seq_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens or self.max_model_len - num_prompt,
            stop_token_ids=frozenset(stops),
        )
        self.sequences[seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, seq_id: int) -> bool:
        """Frees the sequence's slot now; False if it was not live."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORT
        self.scheduler.finish(seq)
        self.generators.release(seq_id)
        return True

    def step(self) -> list[SequenceOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        step_logits = self.runner.execute(scheduled)
        chunks = scheduled.chunks
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        if not step_logits.chunk_indices:
            return []
        seqs = [chunks[i].seq for i in step_logits.chunk_indices]
        batch = SamplingBatch.build(
            [s.sampling for s in seqs],
            [self.generators.for_sequence(s.seq_id, s.sampling.seed) for s in seqs],
            self.runner.vocab_size, self.runner.device,
        )
        sampled = sample(step_logits.logits, batch)
        return self._append_tokens(seqs, sampled)

    def _append_tokens(self, seqs: list[Sequence], sampled: SamplerOutput) -> list[SequenceOutput]:
        # One device->host copy per tensor for the whole batch, not one per sequence.
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        outputs = []
        for row, seq in enumerate(seqs):
            token = token_ids[row]
            seq.output_token_ids.append(token)
            out = SequenceOutput(seq.seq_id, token, num_prompt_tokens=seq.num_prompt_tokens)
            params = seq.sampling
            if params.logprobs and logprobs is not None:
                out.logprob = logprobs[row]
                if params.top_logprobs and top_ids is not None:
                    out.top_token_ids = top_ids[row][:params.top_logprobs]
                    out.top_logprobs = top_lps[row][:params.top_logprobs]
            if token in seq.stop_token_ids:
                seq.finish_reason, seq.stop_token_id = FinishReason.STOP, token
            elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH
            out.num_output_tokens = len(seq.output_token_ids)
            if seq.is_finished:
                out.finish_reason, out.stop_token_id = seq.finish_reason, seq.stop_token_id
                self.scheduler.finish(seq)
                self.generators.release(seq.seq_id)
                del self.sequences[seq.seq_id]
            outputs.append(out)
        return outputs


def default_eos_ids(generation_config: dict, config: dict) -> list[int]:
    eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)



