"""Runs one beam-search request on the engine as rounds of one-token requests.

Each round adds one engine request per live beam (prompt + the beam's tokens, greedy, one
output token, raw top-k logprobs). The prefix cache serves the shared blocks, so a round
costs about one decode per beam plus the beam's last partial block. BeamSearch (pure) picks
the survivors; when it is done, the n best hypotheses go out as the request's outputs, best
first, all at once (nothing streams, as with best_of > n).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import grpc

from model_worker.beam_search import BeamCandidates, BeamSearch
from model_worker.engine import LLMEngine, RequestRejected, SequenceOutput, abort_outputs_unstarted
from model_worker.sequence import FinishReason, SamplingParams

# AddRequest.length_penalty's bound (model_worker.proto): scores divide by length **
# length_penalty, which far beyond transformers' usual 0.6-2 under- or overflows a float.
MAX_ABS_LENGTH_PENALTY = 10.0


def unsupported_settings(p: SamplingParams) -> list[str]:
    """The names of the request's settings that beam search's rounds would not apply."""
    active = {
        "min_p": p.min_p > 0.0, "typical_p": p.typical_p < 1.0, "top_n_sigma": p.top_n_sigma > 0.0,
        "xtc_probability": p.xtc_probability > 0.0, "dry_multiplier": p.dry_multiplier > 0.0,
        "mirostat": p.mirostat != 0, "presence_penalty": p.presence_penalty != 0.0,
        "frequency_penalty": p.frequency_penalty != 0.0, "repetition_penalty": p.repetition_penalty != 1.0,
        "repeat_penalty": p.repeat_penalty != 1.0, "logit_bias": bool(p.logit_bias), "min_tokens": p.min_tokens > 0,
        "bad_words": bool(p.bad_words), "allowed_token_ids": bool(p.allowed_token_ids),
        "prompt_logprobs": p.prompt_logprobs is not None,
    }
    return [name for name, on in active.items() if on]


class BeamSearchRequest:
    def __init__(self, engine: LLMEngine, new_seq_id: Callable[[], int], request_seq_id: int,
                 prompt_token_ids: list[int], sampling: SamplingParams, max_tokens: int,
                 stop_token_ids: list[int], ignore_eos: bool, n: int, best_of: int,
                 length_penalty: float, diversity_penalty: float, cache_salt: str = "") -> None:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        beam_width = best_of or n
        if n < 1 or beam_width < n:
            raise RequestRejected(invalid, f"beam search needs 1 <= n <= best_of (the beam width), got n={n}, "
                                           f"best_of={best_of}", "best_of")
        if beam_width > engine.max_best_of:
            raise RequestRejected(invalid, f"the beam width (best_of) must be <= {engine.max_best_of}, "
                                           f"not {beam_width}", "best_of")
        # Beam search ranks by the model's own logprobs; a temperature or filter would change
        # nothing it could honour, so say so instead of ignoring it (vLLM did the same).
        if not sampling.greedy or sampling.top_k > 0 or sampling.top_p < 1.0:
            culprit = "temperature" if not sampling.greedy else "top_k" if sampling.top_k > 0 else "top_p"
            raise RequestRejected(invalid, "beam search is deterministic: temperature must be 0 and top_k/top_p "
                                           "unset", f"sampling.{culprit}")
        # Its rounds run with default settings, so any setting that would change the logits (or
        # ask for more than the beams' logprobs) would be dropped without a word: refuse it instead.
        if ignored := unsupported_settings(sampling):
            first = ignored[0]
            raise RequestRejected(invalid, f"beam search does not support {', '.join(ignored)}",
                                  first if first == "prompt_logprobs" else f"sampling.{first}")
        if not 0.0 <= diversity_penalty < math.inf:  # NaN too
            raise RequestRejected(invalid, f"diversity_penalty must be finite and >= 0, not {diversity_penalty}",
                                  "diversity_penalty")
        if not abs(length_penalty) <= MAX_ABS_LENGTH_PENALTY:  # NaN too
            raise RequestRejected(invalid, f"length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY:g}, "
                                           f"{MAX_ABS_LENGTH_PENALTY:g}], not {length_penalty}", "length_penalty")
        # The user's own settings, checked as any request's are (its rounds carry their own).
        max_tokens = engine.validate_request(prompt_token_ids, sampling, max_tokens, stop_token_ids)
        stops = frozenset(stop_token_ids) | (frozenset() if ignore_eos else engine.eos_token_ids)
        self.engine = engine
        self.new_seq_id = new_seq_id
        self.request_seq_id = request_seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.cache_salt = cache_salt  # every round's requests share blocks only with the same salt
        self.want_logprobs = sampling.logprobs
        self.search = BeamSearch(beam_width, n, max(max_tokens, 1), stops, length_penalty, diversity_penalty,
                                 top_logprobs=sampling.top_logprobs if sampling.logprobs else 0)
        self.round_sampling = dataclasses.replace(
            SamplingParams(), temperature=0.0, seed=0, logprobs=True,
            top_logprobs=min(self.search.num_candidates, engine.runner.vocab_size))
        self.in_flight: dict[int, int] = {}  # engine seq_id -> live beam index, this round
        self._results: dict[int, BeamCandidates] = {}
        self.n = n
        # The first round's prompt tokens the prefix cache served (later rounds hit their own).
        self.num_cached_prompt_tokens: int | None = None

    def start(self) -> None:
        """Adds the first round; raises RequestRejected if the waiting queue is full, or the engine
        refuses the prompt (after taking back what it added). A search is admitted as one request,
        as a request's n samples are (forked later): its rounds' requests, one per beam, are not
        refused for room, so a width never has to fit the queue, and a search once started is not
        failed half way by other requests filling it."""
        self.engine.check_waiting_room(1)
        try:
            self._add_round(first=True)
        except RequestRejected:
            self.abort()
            raise

    def _add_round(self, first: bool = False) -> None:
        """first: the search's first round, whose first request counts in the waiting room for the
        search until admitted (the others, and later rounds, take no room)."""
        self._results.clear()
        for beam_index, beam in enumerate(self.search.beams):
            seq_id = self.new_seq_id()
            self.engine.add_request(seq_id, self.prompt_token_ids + beam.token_ids, self.round_sampling,
                                    max_tokens=1, stop_token_ids=[], ignore_eos=True, admitted=True,
                                    queued=first and beam_index == 0, cache_salt=self.cache_salt)
            self.in_flight[seq_id] = beam_index

    def on_output(self, out: SequenceOutput) -> list[SequenceOutput] | None:
        """Takes one round request's output; returns the request's outputs once the search ends.
        Raises RequestRejected when the engine refuses the next round (e.g. queue full)."""
        beam_index = self.in_flight.pop(out.seq_id)
        if out.finish_reason in (FinishReason.ABORT, FinishReason.ERROR) or out.token_id is None:
            raise RequestRejected(grpc.StatusCode.INTERNAL, "a beam-search round ended without a token")
        if self.num_cached_prompt_tokens is None:
            self.num_cached_prompt_tokens = out.num_cached_prompt_tokens
        self._results[beam_index] = BeamCandidates(list(out.top_token_ids), list(out.top_logprobs))
        if self.in_flight:
            return None
        self.search.advance([self._results[i] for i in range(len(self.search.beams))])
        if not self.search.done:
            self._add_round()
            return None
        return self._final_outputs()

    def abort(self) -> list[SequenceOutput]:
        for seq_id in self.in_flight:
            self.engine.abort_request(seq_id)
        self.in_flight.clear()
        return abort_outputs_unstarted(self.request_seq_id, len(self.prompt_token_ids), self.n)

    def _final_outputs(self) -> list[SequenceOutput]:
        outputs: list[SequenceOutput] = []
        num_prompt = len(self.prompt_token_ids)
        for index, hyp in enumerate(self.search.best()):
            cumulative = 0.0
            for pos, (token, lp) in enumerate(zip(hyp.token_ids, hyp.logprobs, strict=True)):
                cumulative += lp
                out = SequenceOutput(self.request_seq_id, token, num_prompt_tokens=num_prompt,
                                     num_output_tokens=pos + 1, index=index, raw_logprob=lp,
                                     cumulative_logprob=cumulative,
                                     num_cached_prompt_tokens=self.num_cached_prompt_tokens or 0)
                if self.want_logprobs:
                    out.logprob = lp
                    if hyp.top:
                        out.top_token_ids, out.top_logprobs = hyp.top[pos]
                outputs.append(out)
            last = outputs[-1]
            last.finish_reason = FinishReason.STOP if hyp.stopped else FinishReason.LENGTH
            last.stop_token_id = hyp.token_ids[-1] if hyp.stopped else None
        outputs[-1].request_finished = True
        return outputs
