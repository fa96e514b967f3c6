"""Prompt logprobs: each prompt token's raw logprob given the tokens before it, plus the k most
likely alternatives, gathered chunk by chunk as the prompt is prefilled.

The model runner returns the logits of every prompt position of chunks whose sequence asked for
them (StepLogits.prompt_logits); the engine feeds them here and sends the result with the
sequence's first output token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from model_worker.sampling.processors import topk_lowest_id_first


@dataclass
class PromptLogprobs:
    num_top: int  # alternatives per position
    # Position 0 has no logprob: NaN, rank 0 and a row of -1 / NaN, as the proto says.
    logprobs: list[float] = field(default_factory=lambda: [math.nan])
    # Each token's rank in the vocabulary by logprob: 1 + the tokens at least as likely, itself
    # left out (vLLM counts logprobs >= the token's, itself included).
    ranks: list[int] = field(default_factory=lambda: [0])
    top_token_ids: list[int] = field(default_factory=list)  # row-major [positions, num_top]
    top_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.top_token_ids:
            self.top_token_ids = [-1] * self.num_top
            self.top_logprobs = [math.nan] * self.num_top

    @property
    def num_positions(self) -> int:
        return len(self.logprobs)

    def add_chunk(self, logits: torch.Tensor, first_position: int, prompt_token_ids: list[int]) -> None:
        """logits [n, V]: row j holds the logits after position first_position + j, i.e. the
        prediction of prompt position first_position + j + 1. Positions already recorded (a
        chunk computed again after preemption) are skipped; positions never computed (their KV
        came from the prefix cache) are NaN."""
        target_start = first_position + 1
        while self.num_positions < target_start:  # a gap: positions served from the prefix cache
            self._append_missing()
        skip = self.num_positions - target_start
        if skip >= logits.shape[0]:
            return
        logits = logits[skip:]
        start = target_start + skip
        targets = torch.tensor(prompt_token_ids[start:start + logits.shape[0]], dtype=torch.long,
                               device=logits.device)
        log_probs = logits.float().log_softmax(dim=-1)  # [n, V]
        target_logprobs = log_probs.gather(-1, targets[:, None])  # [n, 1]
        self.logprobs.extend(target_logprobs[:, 0].tolist())
        self.ranks.extend((log_probs >= target_logprobs).sum(dim=-1).tolist())
        if self.num_top:
            top_lps, top_ids = topk_lowest_id_first(log_probs, self.num_top)
            self.top_token_ids.extend(top_ids.flatten().tolist())
            self.top_logprobs.extend(top_lps.flatten().tolist())

    def pad_to(self, num_prompt_tokens: int) -> None:
        """NaN for the trailing positions never computed (the prompt's KV came from the prefix cache)."""
        while self.num_positions < num_prompt_tokens:
            self._append_missing()

    def _append_missing(self) -> None:
        self.logprobs.append(math.nan)
        self.ranks.append(0)
        self.top_token_ids.extend([-1] * self.num_top)
        self.top_logprobs.extend([math.nan] * self.num_top)
