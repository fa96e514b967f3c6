"""One request's samples: n (or best_of) sequences forked from one prefilled prompt.

Owned by the engine; the scheduler only sees the sequences. Decides what each sample's
outputs become on the wire: streamed as they come (best_of == n), or held until every
sample ends and only the n with the highest cumulative logprob sent (best_of > n).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_worker.sequence import Sequence


@dataclass
class SequenceGroup:
    request_id: int
    n: int
    best_of: int
    seqs: list[Sequence] = field(default_factory=list)  # created so far; seqs[i].sample_index == i
    # Per sample index, the summed raw logprob of its chosen tokens (ranks best_of samples).
    cumulative_logprobs: list[float] = field(default_factory=list)
    ended: set[int] = field(default_factory=set)  # sample indices that finished
    # best_of > n: each sample's outputs, held back until the group ends.
    held: dict[int, list] = field(default_factory=dict)

    @property
    def streams(self) -> bool:
        return self.best_of == self.n

    @property
    def is_finished(self) -> bool:
        return len(self.ended) == self.best_of

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def best_indices(self) -> list[int]:
        """The n sample indices with the highest cumulative logprob, best first."""
        order = sorted(range(self.best_of), key=lambda i: self.cumulative_logprobs[i], reverse=True)
        return order[:self.n]
