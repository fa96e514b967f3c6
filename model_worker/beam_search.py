"""Beam search bookkeeping: which beams live, which hypotheses ended, and when to stop.

Pure (no tensors, no engine): each round the caller computes, for every live beam, the
top 2 * beam_width next tokens with their raw logprobs, hands them to advance(), and asks
for the next live beams. EngineLoop drives it with one-token engine requests whose prompts
are the beams, so the prefix cache turns each round into (about) one decode per beam; that
is the split vLLM's V1 engine uses too, and it keeps beam search out of the batched step.

Scoring follows transformers' beam search (as of its 4.4x rewrite): a finished hypothesis scores
cumulative_logprob / num_output_tokens ** length_penalty, the stop token counted (vLLM leaves
it out, but counts the prompt's tokens too, a scale of its own), and
the search ends when beam_width hypotheses are in and no live beam can still beat the worst
of them (transformers' early_stopping=False heuristic), or when max_tokens is reached.
With diversity_penalty > 0 it is transformers' group (diverse) beam search with one beam per
group: each beam in turn loses diversity_penalty per earlier beam of the same round that
chose the same token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)  # output tokens so far
    logprobs: list[float] = field(default_factory=list)  # raw logprob of each output token
    cumulative_logprob: float = 0.0
    # Per output token, the top_logprobs most likely (ids, logprobs) at that position.
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)


@dataclass
class Hypothesis:
    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    score: float
    stopped: bool  # ended on a stop token (else on max_tokens)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)


@dataclass
class BeamCandidates:
    """One live beam's best next tokens, most likely first: ids [2W] and raw logprobs [2W]."""

    token_ids: list[int]
    logprobs: list[float]


class BeamSearch:
    def __init__(self, beam_width: int, n: int, max_tokens: int, stop_token_ids: frozenset[int],
                 length_penalty: float = 1.0, diversity_penalty: float = 0.0, top_logprobs: int = 0) -> None:
        if not 1 <= n <= beam_width:
            raise ValueError(f"need 1 <= n <= beam_width, got n={n}, beam_width={beam_width}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
        self.beam_width = beam_width
        self.n = n
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.length_penalty = length_penalty
        self.diversity_penalty = diversity_penalty
        self.top_logprobs = top_logprobs
        # Plain beam search starts from the prompt alone; the diverse variant starts every group
        # (one beam each) from it, and the penalty pushes them apart from the first token on.
        self.beams: list[Beam] = [Beam() for _ in range(beam_width if diversity_penalty > 0.0 else 1)]
        self.finished: list[Hypothesis] = []
        self.done = False

    @property
    def num_candidates(self) -> int:
        """Candidates asked per beam: W + stop ids, at least 2W, so each beam offers W that do not
        stop however many of its best do, and the joint choice sees every candidate of the best
        W (with 2W and several stop ids, a round could keep fewer than W beams: 2 of 60 searches
        ended on worse hypotheses than transformers'). transformers keeps (1 + stop ids) x W of
        the beams' candidates flattened; per beam, W + stop ids gives the same choice at a cost
        that grows with the stop ids once, not W times. More when the request wants more
        alternatives in its logprobs."""
        return max(self.beam_width + len(self.stop_token_ids), 2 * self.beam_width, self.top_logprobs)

    def score(self, cumulative_logprob: float, num_tokens: int) -> float:
        return cumulative_logprob / max(num_tokens, 1) ** self.length_penalty

    def advance(self, candidates: list[BeamCandidates]) -> None:
        """Extends the live beams by one token each; candidates[i] belongs to self.beams[i]."""
        if self.done:
            raise RuntimeError("beam search already finished")
        if len(candidates) != len(self.beams):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self.beams)} live beams")
        step = len(self.beams[0].token_ids) + 1  # output length after this round
        if self.diversity_penalty > 0.0:
            new_beams = self._advance_diverse(candidates)
        else:
            new_beams = self._advance_joint(candidates)
        if step >= self.max_tokens:
            for beam in new_beams:
                self._finish(beam, stopped=False)
            new_beams = []
        self.beams = new_beams
        self.done = not self.beams or self._cannot_improve()

    def _advance_joint(self, candidates: list[BeamCandidates]) -> list[Beam]:
        # (score so far, beam index, token, logprob), best first over every beam's candidates.
        ranked = sorted(
            ((beam.cumulative_logprob + lp, i, token, lp)
             for i, (beam, cands) in enumerate(zip(self.beams, candidates, strict=True))
             for token, lp in zip(cands.token_ids, cands.logprobs, strict=True)),
            key=lambda c: c[0], reverse=True)
        new_beams: list[Beam] = []
        for rank, (_, i, token, lp) in enumerate(ranked):
            if len(new_beams) == self.beam_width:
                break
            child = self._extend(self.beams[i], token, lp, candidates[i])
            if token in self.stop_token_ids:
                # Only a stop among the top beam_width counts (transformers' rule): a stop far
                # down the list would fill the hypotheses with poor, short answers.
                if rank < self.beam_width:
                    self._finish(child, stopped=True)
            else:
                new_beams.append(child)
        return new_beams

    def _advance_diverse(self, candidates: list[BeamCandidates]) -> list[Beam]:
        chosen_before: Counter[int] = Counter()
        new_beams: list[Beam] = []
        for beam, cands in zip(self.beams, candidates, strict=True):
            ranked = sorted(
                ((beam.cumulative_logprob + lp - self.diversity_penalty * chosen_before[token], token, lp)
                 for token, lp in zip(cands.token_ids, cands.logprobs, strict=True)),
                key=lambda c: c[0], reverse=True)
            # The group has one beam (transformers' group beam search with as many groups as
            # beams): a stop ranked first becomes a hypothesis, the best non-stop continues it.
            for rank, (_, token, lp) in enumerate(ranked):
                child = self._extend(beam, token, lp, cands)
                if token in self.stop_token_ids:
                    if rank == 0:
                        self._finish(child, stopped=True)
                    continue
                chosen_before[token] += 1
                new_beams.append(child)
                break
        return new_beams

    def _extend(self, beam: Beam, token: int, logprob: float, cands: BeamCandidates) -> Beam:
        top = beam.top
        if self.top_logprobs:
            k = self.top_logprobs
            top = top + [(cands.token_ids[:k], cands.logprobs[:k])]
        return Beam(beam.token_ids + [token], beam.logprobs + [logprob], beam.cumulative_logprob + logprob, top)

    def _finish(self, beam: Beam, stopped: bool) -> None:
        self.finished.append(Hypothesis(beam.token_ids, beam.logprobs, beam.cumulative_logprob,
                                        self.score(beam.cumulative_logprob, len(beam.token_ids)), stopped, beam.top))

    def _cannot_improve(self) -> bool:
        if len(self.finished) < self.beam_width:
            return False
        worst_kept = sorted((h.score for h in self.finished), reverse=True)[self.beam_width - 1]
        best_live = max(self.score(b.cumulative_logprob, len(b.token_ids)) for b in self.beams)
        return best_live <= worst_kept

    def best(self) -> list[Hypothesis]:
        """The n best hypotheses, best first; live beams count when the search was cut short."""
        pool = list(self.finished)
        if not self.done:
            pool += [Hypothesis(b.token_ids, b.logprobs, b.cumulative_logprob,
                                self.score(b.cumulative_logprob, len(b.token_ids)), False, b.top)
                     for b in self.beams]
        return sorted(pool, key=lambda h: h.score, reverse=True)[:self.n]
