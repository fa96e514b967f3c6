"""A request inside the engine: its tokens, its sampling parameters and where it stands.

Created by the engine from an AddRequest, moved between queues by the scheduler, and turned
back into SequenceTokens by the servicer; it holds no tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    # Values equal the proto's FinishReason so the servicer copies them as they are.
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # resolved: never beyond the context
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose keys and values are in the cache; the rest still need a forward.
    num_computed_tokens: int = 0
    slot: int = -1
    finish_reason: FinishReason = FinishReason.NONE
    stop_token_id: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_from(self, start: int, count: int) -> list[int]:
        # Slices each list directly: a decode asks for one token every step, and joining
        # prompt + output first would copy the whole sequence each time.
        prompt_len = len(self.prompt_token_ids)
        end = start + count
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE
