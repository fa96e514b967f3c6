"""The engine: validates requests, runs one scheduled step, and reports what each sequence got.

Synchronous and single-threaded by design; the servicer's asyncio loop calls step() in one
named executor thread and applies adds/aborts only between steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from dataclasses import dataclass, field

import grpc
import torch

from model_worker.block_manager import MAX_CACHE_SALT_CHARS, BlockManager, prefix_root
from model_worker.device_transfer import moved_to, tensor_on
from model_worker.model_runner import ModelRunner
from model_worker.sampling import Sampler, SamplerOutput, validate_sampling_params
from model_worker.sampling.prompt_logprobs import PromptLogprobs
from model_worker.scheduler import Scheduler
from model_worker.sequence import FinishReason, SamplingParams, Sequence
from model_worker.sequence_group import SequenceGroup
from model_worker.structured_output import CompiledGrammar, GrammarMatcher, TokenBitmaskFiller, allow_token_

logger = logging.getLogger(__name__)


class RequestRejected(Exception):
    """A request the engine will not run; carries the gRPC status code to report."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field  # the AddRequest field at fault (RequestError.field), if one


@dataclass
class GrammarWait:
    """A grammar that starts later (StructuredOutput.after_token_ids): once the output holds
    `after`, a reasoning model's end of thinking. With `opener`, only where the output's first
    token is that one (Qwen3's <think>, which its thinking mode may or may not open with): the
    first token may be it or one the grammar allows, and any other than it starts the grammar."""

    after: tuple[int, ...]
    opener: int | None = None  # cleared by the first token


@dataclass
class SequenceOutput:
    """What one sample of a request got from one step (at most one new token)."""

    seq_id: int  # the request's id as given to add_request (all its samples share it)
    token_id: int | None
    logprob: float | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    stop_token_id: int | None = None  # the stop token that ended it (FinishReason.STOP)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    index: int = 0  # which of the request's n outputs
    num_cached_prompt_tokens: int = 0
    raw_logprob: float | None = None  # the chosen token's raw logprob, whatever the logprobs mode
    cumulative_logprob: float | None = None  # sum of raw_logprob over this sample's tokens so far
    prompt_logprobs: PromptLogprobs | None = None  # with the first token of sample 0, when asked
    request_finished: bool = False  # the last output of the request: every sample has ended
    error: str | None = None  # why, with FinishReason.ERROR (the request's own settings: INVALID_ARGUMENT)
    error_field: str = ""  # the AddRequest field at fault, where one is (RequestError.field)


def abort_outputs_unstarted(seq_id: int, num_prompt_tokens: int, n: int) -> list[SequenceOutput]:
    """One ABORT output per index (the last marked request_finished) for a request of n outputs of
    which nothing was sent: each index ends with its own finish_reason, as the proto says."""
    outputs = [SequenceOutput(seq_id, None, finish_reason=FinishReason.ABORT, num_prompt_tokens=num_prompt_tokens,
                              index=index) for index in range(max(n, 1))]
    outputs[-1].request_finished = True
    return outputs


class LLMEngine:
    def __init__(self, runner: ModelRunner, eos_token_ids: list[int], max_num_seqs: int,
                 max_num_batched_tokens: int, max_waiting_requests: int, seed: int = 0,
                 enable_prefix_caching: bool = True, max_best_of: int = 16, num_token_ids: int = 0,
                 max_logprobs: int = 20) -> None:
        """num_token_ids: how many ids the tokenizer has (0: as many as the model's vocabulary);
        max_logprobs: most top_logprobs / prompt_logprobs a request may ask for (-1: the vocabulary)."""
        self.runner = runner
        # Models whose vocabulary is padded past their tokenizer's (Qwen2/2.5: 151936 rows for ~151665
        # tokens) must never pick a padding id: no detok can say what it is, and the request would
        # fail mid-stream. Their logits are -inf from here (None: nothing to mask).
        self._padding_from = num_token_ids if 0 < num_token_ids < runner.vocab_size else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = runner.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.max_best_of = max_best_of
        self.max_logprobs = runner.vocab_size if max_logprobs < 0 else max_logprobs
        kv = runner.kv_cache
        # The transformers fallback keeps KV per sequence: no blocks to share by content, and a
        # forked sample's copied cache takes blocks of its own.
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size,
                                          enable_prefix_caching and runner.supports_prefix_caching,
                                          share_blocks_on_fork=runner.supports_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler(runner.vocab_size, runner.device, runner.argmax, runner.gumbel_argmax,
                               runner.top_p_rows)
        # Keys the draws of requests without a seed: random per request, reproducible per worker seed.
        self._unseeded_keys = random.Random(seed)
        self._prompt_logprobs: dict[int, PromptLogprobs] = {}  # by seq_id, while the prompt is prefilled
        self.groups: dict[int, SequenceGroup] = {}  # by request id
        self._group_of: dict[int, SequenceGroup] = {}  # by seq_id of each live sample
        self._seq_ids = itertools.count()
        # Structured output: each constrained sample's position in its grammar, by seq_id.
        self._grammars: dict[int, GrammarMatcher] = {}
        # ... and of those, the ones whose grammar starts later: the output tokens it waits for.
        self._grammar_waits: dict[int, GrammarWait] = {}
        self._bitmask_filler = TokenBitmaskFiller(runner.vocab_size)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def output_budget(self, num_prompt: int, max_tokens: int) -> int:
        """max_tokens checked against the context and resolved (0: all the room the prompt leaves);
        raises RequestRejected saying both lengths."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if num_prompt >= self.max_model_len:
            raise RequestRejected(invalid, f"the prompt has {num_prompt} tokens, but the model's context is "
                                           f"{self.max_model_len} tokens, which leaves no room for output",
                                  "prompt_token_ids")
        if max_tokens < 0:
            raise RequestRejected(invalid, f"max_tokens must be >= 0 (0 means up to the context), not {max_tokens}",
                                  "max_tokens")
        if max_tokens and num_prompt + max_tokens > self.max_model_len:
            raise RequestRejected(invalid, f"this model's maximum context length is {self.max_model_len} tokens, "
                                           f"but {num_prompt + max_tokens} were requested ({num_prompt} in the "
                                           f"prompt, {max_tokens} for the output)", "max_tokens")
        return max_tokens or self.max_model_len - num_prompt

    def validate_request(self, prompt_token_ids: list[int], sampling: SamplingParams, max_tokens: int,
                         stop_token_ids: list[int], internal: bool = False) -> int:
        """A request's output budget (max_tokens within the context); raises RequestRejected
        (INVALID_ARGUMENT) for an empty prompt, ids outside the vocabulary or bad sampling settings.
        internal: a beam search's round, whose candidates may pass max_logprobs (2 x its width)."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        vocab = self.runner.vocab_size
        if not prompt_token_ids:
            raise RequestRejected(invalid, "prompt_token_ids is empty", "prompt_token_ids")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(invalid, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                  "prompt_token_ids")
        bad_stop = [t for t in stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise RequestRejected(invalid, f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab})",
                                  "stop_token_ids")
        max_tokens = self.output_budget(len(prompt_token_ids), max_tokens)
        problem = validate_sampling_params(sampling, vocab, max_tokens, vocab if internal else self.max_logprobs)
        if problem is not None:
            raise RequestRejected(invalid, *problem)
        if (self._padding_from is not None and sampling.allowed_token_ids
                and min(sampling.allowed_token_ids) >= self._padding_from):
            # The vocabulary's padding rows are -inf (step()): nothing would be left to draw.
            raise RequestRejected(invalid, f"allowed_token_ids are all padding ids, past the tokenizer's "
                                           f"{self._padding_from} tokens: no token is left to sample",
                                  "sampling.allowed_token_ids")
        return max_tokens

    def add_request(self, seq_id: int, prompt_token_ids: list[int], sampling: SamplingParams, max_tokens: int,
                    stop_token_ids: list[int], ignore_eos: bool, n: int = 1, best_of: int = 0,
                    grammar: CompiledGrammar | None = None, grammar_wait: GrammarWait | None = None,
                    admitted: bool = False, queued: bool | None = None, cache_salt: str = "") -> Sequence:
        """Validates and queues a request (seq_id: the caller's request id) with n outputs from
        best_of samples (0: n); returns its first sample. Raises RequestRejected with a clear message.
        grammar_wait: the grammar applies once the output holds some tokens (a reasoning model's
        end of thinking). admitted: a round of a request whose room was already checked (beam
        search's), so a full waiting queue does not end it half way. queued: it counts in the waiting
        room until admitted (default: not admitted; a search's first round does, as its request).
        cache_salt: only requests with the same salt share prefix-cache blocks (AddRequest's)."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        max_tokens = self.validate_request(prompt_token_ids, sampling, max_tokens, stop_token_ids, internal=admitted)
        if len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise RequestRejected(invalid, f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, not "
                                           f"{len(cache_salt)}", "cache_salt")
        if grammar is not None and grammar_wait is not None and not all(
                0 <= t < self.runner.vocab_size for t in (*grammar_wait.after, grammar_wait.opener or 0)):
            raise RequestRejected(invalid, "structured output after_token_ids and opening_token_id must be in "
                                           f"[0, {self.runner.vocab_size})", "structured_output")
        best_of = best_of or n
        if n < 1:
            raise RequestRejected(invalid, f"n must be >= 1, not {n}", "n")
        if best_of < n:
            raise RequestRejected(invalid, f"best_of must be >= n ({n}), not {best_of}", "best_of")
        limit = min(self.max_best_of, self.scheduler.max_num_seqs)
        if best_of > limit:
            raise RequestRejected(invalid, f"best_of (or n) must be <= {limit}, not {best_of}", "best_of")
        # After the checks of the request itself: a bad request is a 400 whatever the load, not a 429
        # that a retry would only repeat.
        if not admitted:
            self.check_waiting_room(1)
        if best_of > n:
            # Samples are ranked by the summed logprob of their tokens, wanted or not.
            sampling = dataclasses.replace(sampling, needs_cumulative_logprob=True)
        if seq_id in self.groups:
            raise RequestRejected(grpc.StatusCode.ALREADY_EXISTS, f"sequence {seq_id} already exists")
        if sampling.seed is None:
            # Drawn once the request is accepted: a refused one leaves the next ones' draws as they were.
            sampling = dataclasses.replace(sampling, seed=self._unseeded_keys.getrandbits(64))
        stops = set(stop_token_ids)
        if not ignore_eos:
            stops |= self.eos_token_ids
        seq = Sequence(
            seq_id=next(self._seq_ids),
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stops),
            min_tokens_held_ids=frozenset(stops | self.eos_token_ids),
            num_pending_forks=best_of - 1,
            prefix_root=prefix_root(cache_salt),
        )
        group = SequenceGroup(seq_id, n, best_of, seqs=[seq], cumulative_logprobs=[0.0] * best_of)
        self.groups[seq_id] = group
        self._group_of[seq.seq_id] = group
        if grammar is not None:
            self._grammars[seq.seq_id] = grammar.new_matcher()
            if grammar_wait is not None and grammar_wait.after:
                self._grammar_waits[seq.seq_id] = dataclasses.replace(grammar_wait)  # its own: the first token clears opener
        self.scheduler.add(seq, queued=not admitted if queued is None else queued)
        return seq

    def check_waiting_room(self, num_requests: int) -> None:
        """Raises RESOURCE_EXHAUSTED (retry later) unless num_requests more fit in the waiting queue:
        new requests that free seats will not take at the next step (Scheduler.num_queued_beyond_seats;
        a running request's preempted samples and a search's rounds take no room)."""
        queued = self.scheduler.num_queued_beyond_seats()
        if queued + num_requests > self.max_waiting_requests:
            raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"{queued} requests are already waiting; try again later")

    def abort_request(self, seq_id: int) -> list[SequenceOutput]:
        """Ends every sample of the request and frees their blocks now. Returns one ABORT
        output per index not yet ended (the last marked request_finished); [] if not live."""
        group = self.groups.pop(seq_id, None)
        if group is None:
            return []
        for seq in group.live_seqs():
            seq.finish_reason = FinishReason.ABORT
            self._release(seq)
        if group.streams:
            indices = [i for i in range(group.n) if i not in group.ended]
        else:
            indices = list(range(group.n))
        # A streaming index's last frame carries its counts as far as it got (the frame's fields
        # are the last output's); samples of best_of > n sent nothing, so theirs stay 0.
        by_index = {seq.sample_index: seq for seq in group.seqs} if group.streams else {}
        outputs = [self._abort_output(group, by_index.get(i), i) for i in indices]
        if outputs:
            outputs[-1].request_finished = True
        return outputs

    @staticmethod
    def _abort_output(group: SequenceGroup, seq: Sequence | None, index: int) -> SequenceOutput:
        out = SequenceOutput(group.request_id, None, finish_reason=FinishReason.ABORT,
                             num_prompt_tokens=group.seqs[0].num_prompt_tokens, index=index)
        if seq is not None:
            out.num_output_tokens = len(seq.output_token_ids)
            out.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
            out.cumulative_logprob = group.cumulative_logprobs[index]
        return out

    def abort_outputs(self, seq_id: int, indexes: set[int]) -> list[SequenceOutput]:
        """Ends only the request's samples at these output indexes (one of n choices hit a stop
        string) and frees their blocks; the others go on. One ABORT output per ended sample,
        the last marked request_finished when no sample is left. Only for streaming groups
        (best_of == n) whose samples have all been forked: before that there is nothing to stop."""
        group = self.groups.get(seq_id)
        if group is None or not group.streams or any(s.num_pending_forks for s in group.live_seqs()):
            return []
        outputs = []
        for seq in group.live_seqs():
            if seq.sample_index not in indexes:
                continue
            seq.finish_reason = FinishReason.ABORT
            self._release(seq)
            group.ended.add(seq.sample_index)
            outputs.append(self._abort_output(group, seq, seq.sample_index))
        if outputs and group.is_finished:
            del self.groups[seq_id]
            outputs[-1].request_finished = True
        return outputs

    # --- structured output ---

    def _grammar_bitmask(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The step's allowed-token bitmask [S, ceil(V / 32)] int32 (all ones on unconstrained rows),
        or None when no row is constrained, so such steps pay nothing."""
        if not self._grammars:
            return None
        waits = self._grammar_waits
        matchers = []  # None for a row whose grammar waits (free) or that has none
        openers = []  # (row, token) a waiting grammar's first token may also be
        for row, seq in enumerate(seqs):
            wait = waits.get(seq.seq_id)
            matchers.append(None if wait is not None and wait.opener is None else self._grammars.get(seq.seq_id))
            if wait is not None and wait.opener is not None:
                openers.append((row, wait.opener))
        bitmask = self._bitmask_filler.fill(matchers)
        for row, token in openers:
            allow_token_(bitmask, row, token)
        return moved_to(self.runner.device, bitmask) if bitmask is not None else None

    def _advance_grammar(self, seq: Sequence, matcher: GrammarMatcher, token: int) -> str | None:
        """Moves the sample's grammar past its new token; a complete output ends with STOP (even
        on its last allowed token: the document is whole, so not LENGTH). Returns the grammar's
        error when it takes no more (the sample then ends with it)."""
        if not matcher.accept_token(token):
            # Reached when nothing the grammar allows was left to draw (allowed_token_ids disjoint
            # from it), or when the parser refuses what its mask allowed (llguidance's limits: a
            # row of more than 2000 alternatives): that token is sent, and the sample ends there.
            error = matcher.error.partition("\n")[0]
            logger.warning("sequence %d: its grammar took no more at token %d: %s", seq.seq_id, token, error)
            seq.finish_reason = FinishReason.ERROR
            return error
        if matcher.is_finished:
            seq.finish_reason = FinishReason.STOP
        return None

    # --- end of structured output ---

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.sampler.release(seq.seq_id)
        if not self.scheduler.has_work():
            self.runner.engine_idle()
        self._prompt_logprobs.pop(seq.seq_id, None)
        self._group_of.pop(seq.seq_id, None)
        self._grammars.pop(seq.seq_id, None)
        self._grammar_waits.pop(seq.seq_id, None)

    def step(self) -> list[SequenceOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        step_logits = self.runner.execute(scheduled)
        if self._padding_from is not None:
            with torch.inference_mode():  # the runner made them there
                for logits in (step_logits.logits, *(part.logits for part in step_logits.prompt_logits)):
                    logits[..., self._padding_from:] = float("-inf")
        chunks = scheduled.chunks
        self.scheduler.update_computed(scheduled)
        for part in step_logits.prompt_logits:
            seq = chunks[part.chunk_index].seq
            record = self._prompt_logprobs.setdefault(seq.seq_id, PromptLogprobs(seq.sampling.prompt_logprobs))
            record.add_chunk(part.logits, part.first_position, seq.prompt_token_ids)
        if not step_logits.chunk_indices:
            return []
        seqs = [chunks[i].seq for i in step_logits.chunk_indices]
        seqs, logits = self._fork_samples(seqs, step_logits.logits)
        sampled = self.sampler.sample(logits, seqs, allowed_token_bitmask=self._grammar_bitmask(seqs))
        return self._group_outputs(seqs, self._append_tokens(seqs, sampled))

    def _fork_samples(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """A request's first sample just finished its prompt: fork the others from it, sharing
        its KV blocks, each drawing its first token from a copy of the same logits row [V]."""
        if not any(s.num_pending_forks for s in seqs):
            return seqs, logits
        rows: list[int] = []
        expanded: list[Sequence] = []
        for row, seq in enumerate(seqs):
            rows.append(row)
            expanded.append(seq)
            if not seq.num_pending_forks:
                continue
            group = self._group_of[seq.seq_id]
            for _ in range(seq.num_pending_forks):
                child = Sequence(
                    seq_id=next(self._seq_ids), prompt_token_ids=seq.prompt_token_ids, sampling=seq.sampling,
                    max_tokens=seq.max_tokens, stop_token_ids=seq.stop_token_ids,
                    min_tokens_held_ids=seq.min_tokens_held_ids, num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
                    sample_index=len(group.seqs), prefix_root=seq.prefix_root,
                )
                self.scheduler.fork(seq, child)
                group.seqs.append(child)
                self._group_of[child.seq_id] = group
                if seq.seq_id in self._grammars:
                    self._grammars[child.seq_id] = self._grammars[seq.seq_id].fork()
                if seq.seq_id in self._grammar_waits:
                    self._grammar_waits[child.seq_id] = dataclasses.replace(self._grammar_waits[seq.seq_id])
                rows.append(row)
                expanded.append(child)
            seq.num_pending_forks = 0
        return expanded, logits.index_select(0, tensor_on(logits.device, rows, torch.long))  # [S', V]

    def _group_outputs(self, seqs: list[Sequence], outputs: list[SequenceOutput]) -> list[SequenceOutput]:
        """Per-sample outputs -> what the caller sees: request id and index set, finished
        samples released, best_of > n samples held back until the group ends."""
        routed: list[SequenceOutput] = []
        for seq, out in zip(seqs, outputs, strict=True):
            group = self._group_of.get(seq.seq_id)
            if group is None:  # a sample of a request that failed earlier in this step
                continue
            out.seq_id = group.request_id
            out.index = seq.sample_index
            out.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
            if out.raw_logprob is not None:
                group.cumulative_logprobs[seq.sample_index] += out.raw_logprob
                out.cumulative_logprob = group.cumulative_logprobs[seq.sample_index]
            if seq.is_finished:
                self._release(seq)
                group.ended.add(seq.sample_index)
            if seq.finish_reason == FinishReason.ERROR:
                # An error ends the whole request (the proto's rule, which the gateway acts on):
                # its other samples stop here, their blocks freed, and the error is its last output.
                for other in group.seqs:
                    if other.seq_id in self._group_of:  # not released yet (this step's outputs included)
                        if not other.is_finished:
                            other.finish_reason = FinishReason.ABORT
                        self._release(other)
                del self.groups[group.request_id]
                out.request_finished = True
                routed.append(out)
                continue
            if group.streams:
                routed.append(out)
            else:
                group.held.setdefault(seq.sample_index, []).append(out)
            if group.is_finished:
                del self.groups[group.request_id]
                if not group.streams:
                    routed.extend(self._best_outputs(group))
                routed[-1].request_finished = True
        return routed

    @staticmethod
    def _best_outputs(group: SequenceGroup) -> list[SequenceOutput]:
        """best_of > n: the n best samples' held outputs, re-indexed 0..n-1, best first. The prompt's
        logprobs came with sample 0's first token (_append_tokens); they go with the first output
        returned, which sample 0 need not be among."""
        prompt_logprobs = next((out.prompt_logprobs for out in group.held.get(0, [])
                                if out.prompt_logprobs is not None), None)
        outputs = []
        for new_index, index in enumerate(group.best_indices()):
            wanted = group.seqs[index].sampling.logprobs
            for out in group.held[index]:
                out.index = new_index
                out.prompt_logprobs = None
                if not wanted:  # computed only to rank the samples
                    out.logprob = None
                outputs.append(out)
        outputs[0].prompt_logprobs = prompt_logprobs
        return outputs

    def _append_tokens(self, seqs: list[Sequence], sampled: SamplerOutput) -> list[SequenceOutput]:
        # One device->host copy per tensor for the whole batch, not one per sequence, and one
        # host sync for all of them (to_host).
        sampled = sampled.to_host()
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        raw_logprobs = sampled.raw_logprobs.tolist() if sampled.raw_logprobs is not None else None
        top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        no_token_left = sampled.no_token_left.tolist() if sampled.no_token_left is not None else None
        outputs = []
        for row, seq in enumerate(seqs):
            token = token_ids[row]
            seq.output_token_ids.append(token)
            out = SequenceOutput(seq.seq_id, token, num_prompt_tokens=seq.num_prompt_tokens)
            params = seq.sampling
            if params.wants_chosen_logprob and raw_logprobs is not None:
                out.raw_logprob = raw_logprobs[row]
            if params.logprobs and logprobs is not None:
                out.logprob = logprobs[row]
                if params.top_logprobs and top_ids is not None:
                    out.top_token_ids = top_ids[row][:params.top_logprobs]
                    out.top_logprobs = top_lps[row][:params.top_logprobs]
            if params.prompt_logprobs is not None and len(seq.output_token_ids) == 1 and seq.sample_index == 0:
                record = self._prompt_logprobs.pop(seq.seq_id, None) or PromptLogprobs(params.prompt_logprobs)
                record.pad_to(seq.num_prompt_tokens)
                out.prompt_logprobs = record
            if token in seq.stop_token_ids:
                seq.finish_reason, seq.stop_token_id = FinishReason.STOP, token
            elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH
            grammar_error = None
            matcher = self._grammars.get(seq.seq_id)
            if (matcher is not None and seq.finish_reason == FinishReason.STOP and seq.seq_id not in self._grammar_waits
                    and matcher.dead_end):
                # The mask allowed eos only because nothing the grammar allows could follow: the
                # output breaks its constraint, so it ends with the error, not as a success (review 103).
                seq.finish_reason, seq.stop_token_id = FinishReason.ERROR, None
                grammar_error = f"no text the grammar allows can follow ({matcher.error.partition(chr(10))[0]})"
            if matcher is not None and seq.finish_reason in (FinishReason.NONE, FinishReason.LENGTH):
                wait = self._grammar_waits.get(seq.seq_id)
                if wait is not None and wait.opener is not None:  # the first token decides
                    if token == wait.opener:
                        wait.opener = None  # thinking: free until `after`
                    else:
                        del self._grammar_waits[seq.seq_id]  # no thinking: this token is the grammar's
                        wait = None
                if wait is None:
                    grammar_error = self._advance_grammar(seq, matcher, token)
                elif wait.opener is None and tuple(seq.output_token_ids[-len(wait.after):]) == wait.after:
                    del self._grammar_waits[seq.seq_id]  # from the next token on
            masked_out = no_token_left is not None and no_token_left[row]
            if masked_out:
                # Every token masked (allowed_token_ids against bad_words, or against min_tokens
                # holding off its stop ids): the drawn id is arbitrary, sent with the error, as a
                # grammar's dead end is.
                seq.finish_reason, seq.stop_token_id = FinishReason.ERROR, None
            out.num_output_tokens = len(seq.output_token_ids)
            if seq.is_finished:
                out.finish_reason, out.stop_token_id = seq.finish_reason, seq.stop_token_id
                if seq.finish_reason == FinishReason.ERROR and grammar_error is not None and not masked_out:
                    out.error = f"the structured output grammar took no more after {len(seq.output_token_ids) - 1} " \
                                f"output tokens: {grammar_error}"
                    out.error_field = "structured_output"
                elif seq.finish_reason == FinishReason.ERROR:
                    out.error = ("no token was left that the request's allowed_token_ids, bad_words, min_tokens (which "
                                 "holds off the stop ids) and structured output grammar all allow")
            outputs.append(out)
        return outputs


def default_eos_ids(generation_config: dict, config: dict, tokenizer_eos_id: int | None = None) -> list[int]:
    """The ids that end an output: generation_config.json's (else config.json's), and the
    tokenizer's own eos token, as vLLM stops on both (a ChatML fine-tune's config may still name
    <|endoftext|> where its turns end with <|im_end|>, the tokenizer's eos)."""
    eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer_eos_id is not None and tokenizer_eos_id not in ids:
        ids.append(tokenizer_eos_id)
    return ids



