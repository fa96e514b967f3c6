"""SamplingBatch: the batch-level tensor view of S requests' SamplingParams, built when the set of
rows changes (not every step), with the device-side token statistics their penalties read.

Built by sampler.py from the engine's Sequences: a feature no row uses has no tensor, and a step
(a penalty, a filter) carries the rows that use it, so the others are not touched (RowParams).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_worker.device_transfer import moved_to, tensor_on
from model_worker.sampling.penalties import dry_max_exponent
from model_worker.sampling.token_state import StateNeeds, TokenState
from model_worker.sequence import LogprobsMode, SamplerOrder, SamplingParams, Sequence

SparseIds = tuple[torch.Tensor, torch.Tensor]  # (rows [N], token ids [N]) long


@dataclass
class DryBatch:
    rows: torch.Tensor  # [D] rows of the batch that use DRY
    multiplier: torch.Tensor  # [D] float32
    base: torch.Tensor  # [D] float32
    allowed_length: torch.Tensor  # [D] long
    max_exponent: torch.Tensor  # [D] long, 0: no clamp
    last_n: torch.Tensor  # [D] long, <= 0: the whole context
    breakers: torch.Tensor  # [D, B, L] long, -1 padded
    single_breakers: torch.Tensor  # [D, B] long, -1 padded: never penalised
    max_match: int  # longest match worth measuring
    max_last_n: int  # 0: some row looks at its whole context


@dataclass
class RowParams:
    """One step's rows and their parameter values: a step touches only the rows that use it."""

    rows: torch.Tensor | None  # [R] long; None: every row of the batch
    values: torch.Tensor  # [R, C]
    limit: int = 0  # top_k: the largest k of these rows


@dataclass
class FilterStep:
    name: str  # temperature, top_k, top_p, min_p, typical_p, top_n_sigma, xtc
    on: RowParams


# The two chains (SamplerOrder); penalties, bias and masks come before either.
DEFAULT_CHAIN = ("temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc")
# llama.cpp's default order (common_params_sampling::samplers): top-n-sigma first, so its mean and
# std are over the whole vocabulary, not over what top_k etc. left.
LLAMA_CPP_CHAIN = ("top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature")


def _step_values(p: SamplingParams, name: str, vocab_size: int) -> list[float] | None:
    """The row's values for a chain step, or None when the step is a no-op for it."""
    if name == "temperature":
        return [p.temperature] if p.temperature != 1.0 else None
    if name == "top_k":
        return [p.top_k] if 0 < p.top_k < vocab_size else None
    if name == "top_p":
        return [p.top_p] if p.top_p < 1.0 else None
    if name == "min_p":
        return [p.min_p] if p.min_p > 0.0 else None
    if name == "typical_p":
        return [p.typical_p] if p.typical_p < 1.0 else None
    if name == "top_n_sigma":
        return [p.top_n_sigma] if p.top_n_sigma > 0.0 else None
    if name == "xtc":
        return [p.xtc_threshold, p.xtc_probability] if p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5 else None
    raise ValueError(name)


@dataclass
class SamplingBatch:
    seq_ids: list[int]
    # seq.num_tokens each row's statistics are current for; a row whose sequence moved on
    # differently (preempted and refilled, forked) is rebuilt from its token lists.
    expected_num_tokens: list[int]
    params: list[SamplingParams]
    # Every row greedy and nothing that changes logits: argmax of the raw logits is the answer.
    fast_greedy: bool
    any_sampled: bool
    sampled_rows: torch.Tensor | None  # [R] rows that draw (None: every row, or none when all greedy)
    # Filters and temperature of sampled rows, in each row's chain order (both chains' steps touch
    # disjoint rows, so they run one after the other on the same tensor).
    chain: list[FilterStep]
    mirostat: RowParams | None  # values [R, 2]: tau, eta
    mirostat_mu: torch.Tensor | None  # [R, 1], state: updated after every draw
    repetition: RowParams | None  # HF repetition_penalty, [R, 1]
    presence_frequency: RowParams | None  # [R, 2]
    repeat: RowParams | None  # llama.cpp repeat_penalty, [R, 1]
    dry: DryBatch | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, ids, values
    allowed_rows: torch.Tensor | None  # [A]
    # [M] rows whose own masks can leave nothing a grammar allows (allowed_token_ids, bad words,
    # min_tokens' held-off ids); None: none
    maskable_rows: torch.Tensor | None
    allowed_mask: torch.Tensor | None  # [A, V] bool
    banned: SparseIds | None  # single-token bad words: always masked
    bad_word_prefixes: list[tuple[int, tuple[int, ...], int]]  # (row, prefix, last id), checked per step
    min_tokens: torch.Tensor | None  # [S] long
    stop_ids: SparseIds | None  # masked while num_output < min_tokens
    seed_lo: torch.Tensor  # [S] long, low 32 bits of the seed
    seed_hi: torch.Tensor  # [S] long
    sample_index: torch.Tensor  # [S] long
    processed_logprobs: torch.Tensor | None  # [S] bool rows whose logprobs are processed ones
    want_chosen: bool
    max_top_logprobs: int
    state: TokenState

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device, previous: SamplingBatch | None,
              saved_mu: dict[int, float]) -> SamplingBatch:
        """saved_mu: mirostat's mu of sequences seen before (seq_id -> mu)."""
        params = [s.sampling for s in seqs]
        reuse = _reuse_rows(seqs, previous)

        def row_params(values: list[list[float] | None], dtype: torch.dtype = torch.float32) -> RowParams | None:
            picked = [i for i, v in enumerate(values) if v is not None]
            if not picked:
                return None
            rows = None if len(picked) == len(values) else tensor_on(device, picked, torch.long)
            return RowParams(rows, tensor_on(device, [values[i] for i in picked], dtype))

        greedy = [p.greedy for p in params]
        chain: list[FilterStep] = []
        for order, names in ((SamplerOrder.DEFAULT, DEFAULT_CHAIN), (SamplerOrder.LLAMA_CPP, LLAMA_CPP_CHAIN)):
            for name in names:
                # top_p keeps float64 values: 1 - p is then rounded as transformers rounds it.
                dtype = {"top_k": torch.long, "top_p": torch.float64}.get(name, torch.float32)
                values = [_step_values(p, name, vocab_size) if p.sampler_order == order and not p.greedy
                          else None for p in params]
                on = row_params(values, dtype)
                if on is not None:
                    if name == "top_k":  # from the host's values: on.values.max() would sync a GPU
                        on.limit = max(v[0] for v in values if v is not None)
                    chain.append(FilterStep(name, on))
        mirostat = row_params([[p.mirostat_tau, p.mirostat_eta] if p.mirostat == 2 and not p.greedy else None
                               for p in params])
        mu = None
        if mirostat is not None:
            mu = tensor_on(device, [[saved_mu.get(s.seq_id, 2.0 * s.sampling.mirostat_tau)] for s in seqs
                                    if s.sampling.mirostat == 2 and not s.sampling.greedy], torch.float32)
        repetition = row_params([[p.repetition_penalty] if p.repetition_penalty != 1.0 else None for p in params])
        presence_frequency = row_params([[p.presence_penalty, p.frequency_penalty]
                                         if p.presence_penalty or p.frequency_penalty else None for p in params])
        uses_repeat = [p.repeat_penalty != 1.0 and p.penalty_last_n != 0 for p in params]
        repeat = row_params([[p.repeat_penalty] if u else None for u, p in zip(uses_repeat, params, strict=True)])
        uses_dry = [p.dry_multiplier > 0 and p.dry_penalty_last_n != 0 for p in params]
        needs = StateNeeds(output_counts=presence_frequency is not None, seen=repetition is not None,
                           window_counts=repeat is not None,
                           history=any(uses_dry) or any(u and p.penalty_last_n > 0
                                                        for u, p in zip(uses_repeat, params, strict=True)))
        state = TokenState.build(seqs, needs, [p.penalty_last_n if u else -1 for u, p in
                                               zip(uses_repeat, params, strict=True)],
                                 vocab_size, device, previous.state if previous else None, reuse)

        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        banned = [(i, w[0]) for i, p in enumerate(params) for w in p.bad_words if len(w) == 1]
        with_min = [(i, t) for i, (s, p) in enumerate(zip(seqs, params, strict=True)) if p.min_tokens
                    for t in sorted(s.min_tokens_held_ids or s.stop_token_ids)]  # (one built without them)
        maskable = [i for i, p in enumerate(params) if p.allowed_token_ids or p.bad_words or p.min_tokens]
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
        allowed_mask = None
        if allowed:
            allowed_mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool)
            for a, i in enumerate(allowed):
                allowed_mask[a, list(params[i].allowed_token_ids)] = True
            allowed_mask = moved_to(device, allowed_mask)
        processed = [p.logprobs and p.logprobs_mode == LogprobsMode.PROCESSED for p in params]
        seeds = [p.seed or 0 for p in params]
        changes_logits = (repetition or presence_frequency or repeat or any(uses_dry) or bias or banned
                          or any(p.bad_words for p in params) or with_min or allowed)
        return cls(
            seq_ids=[s.seq_id for s in seqs],
            expected_num_tokens=[s.num_tokens for s in seqs],
            params=params,
            fast_greedy=all(greedy) and not changes_logits and not any(processed),
            any_sampled=not all(greedy),
            sampled_rows=None if all(greedy) or not any(greedy) else tensor_on(
                device, [i for i, g in enumerate(greedy) if not g], torch.long),
            chain=chain,
            mirostat=mirostat,
            mirostat_mu=mu,
            repetition=repetition,
            presence_frequency=presence_frequency,
            repeat=repeat,
            dry=_dry_batch([i for i, u in enumerate(uses_dry) if u], params, device) if any(uses_dry) else None,
            logit_bias=(tensor_on(device, [i for i, _, _ in bias], torch.long),
                        tensor_on(device, [t for _, t, _ in bias], torch.long),
                        tensor_on(device, [b for _, _, b in bias], torch.float32)) if bias else None,
            allowed_rows=tensor_on(device, allowed, torch.long) if allowed else None,
            maskable_rows=tensor_on(device, maskable, torch.long) if maskable else None,
            allowed_mask=allowed_mask,
            banned=_sparse(banned, device),
            bad_word_prefixes=[(i, tuple(w[:-1]), w[-1]) for i, p in enumerate(params) for w in p.bad_words
                               if len(w) > 1],
            min_tokens=tensor_on(device, [p.min_tokens for p in params], torch.long)
            if with_min else None,
            stop_ids=_sparse(with_min, device),
            seed_lo=tensor_on(device, [s & 0xFFFFFFFF for s in seeds], torch.long),
            seed_hi=tensor_on(device, [s >> 32 for s in seeds], torch.long),
            sample_index=tensor_on(device, [s.sample_index for s in seqs], torch.long),
            processed_logprobs=tensor_on(device, processed, torch.bool) if any(processed) else None,
            want_chosen=any(p.wants_chosen_logprob for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params if p.logprobs), default=0),
            state=state,
        )

    def saved_mirostat_mu(self) -> dict[int, float]:
        """seq_id -> mu of every mirostat row, to carry over to a later batch."""
        if self.mirostat is None:
            return {}
        rows = range(len(self.seq_ids)) if self.mirostat.rows is None else self.mirostat.rows.tolist()
        return {self.seq_ids[r]: mu for r, mu in zip(rows, self.mirostat_mu.view(-1).tolist(), strict=True)}


def _reuse_rows(seqs: list[Sequence], previous: SamplingBatch | None) -> list[int | None]:
    if previous is None:
        return [None] * len(seqs)
    where = {sid: row for row, sid in enumerate(previous.seq_ids)}
    out: list[int | None] = []
    for s in seqs:
        row = where.get(s.seq_id)
        out.append(row if row is not None and previous.expected_num_tokens[row] == s.num_tokens else None)
    return out


def _sparse(pairs: list[tuple[int, int]], device: torch.device) -> SparseIds | None:
    if not pairs:
        return None
    return (tensor_on(device, [r for r, _ in pairs], torch.long),
            tensor_on(device, [t for _, t in pairs], torch.long))


def _dry_batch(rows: list[int], params: list[SamplingParams], device: torch.device) -> DryBatch:
    dry_params = [params[i] for i in rows]
    width = max((len(b) for p in dry_params for b in p.dry_sequence_breakers), default=0)
    count = max((len(p.dry_sequence_breakers) for p in dry_params), default=0)
    breakers = torch.full((len(rows), count, width), -1, dtype=torch.long)
    singles = [[seq[0] for seq in p.dry_sequence_breakers if len(seq) == 1] for p in dry_params]
    single_breakers = torch.full((len(rows), max((len(x) for x in singles), default=0)), -1, dtype=torch.long)
    for d, p in enumerate(dry_params):
        single_breakers[d, :len(singles[d])] = torch.tensor(singles[d], dtype=torch.long)
        for b, seq in enumerate(p.dry_sequence_breakers):
            breakers[d, b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    max_exponents = [dry_max_exponent(p.dry_base) for p in dry_params]
    last_n = [p.dry_penalty_last_n for p in dry_params]
    return DryBatch(
        rows=tensor_on(device, rows, torch.long),
        multiplier=tensor_on(device, [p.dry_multiplier for p in dry_params], torch.float32),
        base=tensor_on(device, [p.dry_base for p in dry_params], torch.float32),
        allowed_length=tensor_on(device, [p.dry_allowed_length for p in dry_params], torch.long),
        max_exponent=tensor_on(device, max_exponents, torch.long),
        last_n=tensor_on(device, last_n, torch.long),
        breakers=moved_to(device, breakers),
        single_breakers=moved_to(device, single_breakers),
        max_match=max(p.dry_allowed_length + e for p, e in zip(dry_params, max_exponents, strict=True)),
        max_last_n=0 if any(n <= 0 for n in last_n) else max(last_n),
    )
