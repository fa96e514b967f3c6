"""Turns a step's logits into next tokens and logprobs for the whole batch at once.

The per-request parameters are gathered into tensors (SamplingBatch) when the batch is
built; the math then runs on [S, V] tensors with no Python loop over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_worker.sequence import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] long
    logprobs: torch.Tensor | None  # [S] float32, chosen token's raw logprob
    top_token_ids: torch.Tensor | None  # [S, K] long, K = the batch's largest top_logprobs
    top_logprobs: torch.Tensor | None  # [S, K] float32


class SeededGenerators:
    """One torch.Generator per seeded request, advanced only by that request's draws, so
    its samples do not depend on what else shares the batch."""

    def __init__(self, device: torch.device, shared_seed: int) -> None:
        self.device = device
        self.shared = torch.Generator(device=device)
        self.shared.manual_seed(shared_seed)
        self._by_seq: dict[int, torch.Generator] = {}

    def for_sequence(self, seq_id: int, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.shared
        gen = self._by_seq.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._by_seq[seq_id] = gen
        return gen

    def release(self, seq_id: int) -> None:
        self._by_seq.pop(seq_id, None)


@dataclass
class SamplingBatch:
    """Batch-level tensor view of S requests' SamplingParams."""

    all_greedy: bool
    greedy: torch.Tensor  # [S] bool
    temperature: torch.Tensor  # [S, 1] float32, 1.0 where greedy (unused there)
    top_k: torch.Tensor  # [S, 1] long, V where off
    top_p: torch.Tensor  # [S, 1] float32
    needs_top_k: bool
    needs_top_p: bool
    generators: list[torch.Generator]
    want_logprobs: bool
    max_top_logprobs: int

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator], vocab_size: int,
              device: torch.device) -> SamplingBatch:
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        return cls(
            all_greedy=all(greedy),
            greedy=torch.tensor(greedy, device=device),
            temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                     dtype=torch.float32, device=device)[:, None],
            top_k=torch.tensor(top_k, device=device)[:, None],
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device)[:, None],
            needs_top_k=any(k < vocab_size for k in top_k),
            needs_top_p=any(p < 1.0 for p in top_p),
            generators=generators,
            want_logprobs=any(p.logprobs for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params if p.logprobs), default=0),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      needs_top_k: bool, needs_top_p: bool) -> torch.Tensor:
    """logits [S, V] -> logits with filtered-out tokens at -inf (per-row k and p)."""
    if not needs_top_k and not needs_top_p:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [S, V]
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if needs_top_k:
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        remove |= ranks >= top_k
    if needs_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Mass strictly before each token: a token is kept while the mass before it is
        # below top_p, so the most likely token always survives.
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits [S, V] float32 -> next tokens; logprobs are the raw model's log-softmax."""
    logprobs_all = logits.log_softmax(dim=-1) if batch.want_logprobs else None
    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        scaled = logits / batch.temperature
        filtered = apply_top_k_top_p(scaled, batch.top_k, batch.top_p, batch.needs_top_k, batch.needs_top_p)
        probs = filtered.softmax(dim=-1)  # [S, V]
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p. Each row's
        # noise comes from its own generator, so a seeded row is independent of the batch.
        noise = torch.empty_like(probs)
        for row, gen in enumerate(batch.generators):
            noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(batch.greedy, logits.argmax(dim=-1), sampled)
    if logprobs_all is None:
        return SamplerOutput(token_ids, None, None, None)
    chosen = logprobs_all.gather(-1, token_ids[:, None])[:, 0]
    top_ids = top_lps = None
    if batch.max_top_logprobs > 0:
        top_lps, top_ids = logprobs_all.topk(batch.max_top_logprobs, dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_lps)
