"""The Sampler: turns one step's logits [S, V] into a token per row, with logprobs, for the whole
batch at once, following each row's chain (HF's order or llama.cpp's).

The engine calls sample() once per step with the Sequences the rows belong to; the batch's tensor
view (batch.py) is rebuilt only when those rows change, and the token statistics are updated in
place with each step's new tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_worker.device_transfer import tensor_on
from model_worker.sampling import penalties, processors
from model_worker.sampling.batch import FilterStep, RowParams, SamplingBatch
from model_worker.sampling.counter_random import (
    STREAM_TOKEN,
    STREAM_XTC,
    column_counters,
    gumbel_noise,
    row_keys,
    uniforms,
)
from model_worker.sequence import Sequence

NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] long
    # [S] float32: the chosen token's logprob in each row's LogprobsMode (rows that asked for none
    # hold a value that is not meant to be read)
    logprobs: torch.Tensor | None
    raw_logprobs: torch.Tensor | None  # [S] float32, the raw model's, for cumulative_logprob
    top_token_ids: torch.Tensor | None  # [S, K] long, K = the batch's largest top_logprobs
    top_logprobs: torch.Tensor | None  # [S, K] float32
    # [S] bool, True where the row's own masks left no token (allowed_token_ids against its bad
    # words, or against min_tokens holding off its stop ids): the drawn id is then arbitrary (0),
    # and the engine ends that sample with an error. None: no row has allowed_token_ids.
    no_token_left: torch.Tensor | None = None

    def to_host(self) -> SamplerOutput:
        """The same tensors on the CPU, with one host sync for all of them: each device tensor is
        queued as a non-blocking copy (into pinned memory) and the stream is waited on once, where
        a .tolist() per tensor would wait once each (up to five per step). CPU tensors come back
        as they are."""
        fields = (self.token_ids, self.logprobs, self.raw_logprobs, self.top_token_ids, self.top_logprobs,
                  self.no_token_left)
        device = self.token_ids.device  # the sampler makes them all on one device
        if device.type == "cpu":
            return self
        overlap = device.type == "cuda"  # other backends: plain blocking copies, still correct
        host = [None if t is None else t.to("cpu", non_blocking=overlap) for t in fields]
        if overlap:
            torch.cuda.current_stream(device).synchronize()
        return SamplerOutput(*host)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 gumbel_argmax: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 top_p_rows: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 ) -> None:
        """argmax: a faster torch.argmax(logits, dim=-1) for greedy rows, gumbel_argmax: a faster
        argmax(logits + gumbel_noise(keys, columns), dim=-1) for sampled rows, top_p_rows: top_p's
        cut without a sort (the CPU kernels of model_worker/kernels/sampling_ops.cpp), or None for
        torch's."""
        self.vocab_size = vocab_size
        self.device = device
        self._argmax = argmax or functools.partial(torch.argmax, dim=-1)
        self._gumbel_argmax = gumbel_argmax
        self._top_p_removed = functools.partial(processors.top_p_removed, kernel=top_p_rows)
        self.batch: SamplingBatch | None = None
        self._columns = column_counters(vocab_size, device)  # [V]
        self._saved_mu: dict[int, float] = {}  # mirostat state of sequences out of the batch
        self._released: set[int] = set()  # ended since the batch was built: not carried over from it

    def release(self, seq_id: int) -> None:
        """Forgets a finished or aborted sequence's carried-over state."""
        self._saved_mu.pop(seq_id, None)
        self._released.add(seq_id)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               allowed_token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """logits [S, V] (row i belongs to seqs[i]) -> one token per row.

        allowed_token_bitmask: [S, ceil(V / 32)] int32 (xgrammar's layout, bit j of word w allows
        token 32 * w + j; a row of all -1 is unconstrained), the structured-output hook: applied
        to the logits first, as vLLM V1 applies it before its sampler, so raw logprobs (and
        cumulative_logprob) are over the tokens the grammar allows; a guided choice's token read
        p=0.008 with five forbidden alternatives when they were taken before it.
        """
        batch = self._batch_for(seqs)
        logits = logits.float()
        if allowed_token_bitmask is not None:
            logits = processors.masked_by_bitmask(logits, allowed_token_bitmask)
        if batch.fast_greedy:
            token_ids = self._argmax(logits)
            out = self._logprobs(batch, logits, None, token_ids)
        else:
            final = self._process(batch, logits, seqs, None)
            token_ids = self._draw(batch, final)
            out = self._logprobs(batch, logits, final, token_ids)
            # Only allowed_token_ids can leave a row empty (the vocabulary is too large for bad words
            # or stop ids to, and no filter drops the best token), or with a grammar's mask bad words
            # and min_tokens' held-off ids too (a grammar that takes only "x", with "x" a bad word:
            # token 0 was drawn, blamed on the grammar; review 100). A grammar's own dead end the
            # engine finds in its matcher. Checked on those rows only: a [S, V] max a step.
            rows = batch.allowed_rows if allowed_token_bitmask is None else batch.maskable_rows
            if rows is not None:
                out.no_token_left = torch.zeros(len(seqs), dtype=torch.bool, device=final.device).index_copy_(
                    0, rows, final.index_select(0, rows).amax(-1) == NEG_INF)
        batch.state.append(token_ids)
        batch.expected_num_tokens = [n + 1 for n in batch.expected_num_tokens]
        return out

    def processed_logits(self, logits: torch.Tensor, seqs: list[Sequence],
                         allowed_token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """logits [S, V] -> the logits each row would draw from (bias, penalties, masks, chain),
        without drawing or advancing any state: what LOGPROBS_MODE_PROCESSED reads."""
        batch = self._batch_for(seqs)
        return self._process(batch, logits.float(), seqs, allowed_token_bitmask)

    def _batch_for(self, seqs: list[Sequence]) -> SamplingBatch:
        batch = self.batch
        if (batch is not None and batch.seq_ids == [s.seq_id for s in seqs]
                and all(s.num_tokens == n for s, n in zip(seqs, batch.expected_num_tokens, strict=True))):
            return batch
        if batch is not None:
            # The rows of sequences still live (preempted, or not scheduled this step) keep their mu;
            # an ended one's would stay here forever (seq ids are never reused).
            self._saved_mu.update((seq_id, mu) for seq_id, mu in batch.saved_mirostat_mu().items()
                                  if seq_id not in self._released)
        self._released.clear()
        self.batch = SamplingBatch.build(seqs, self.vocab_size, self.device, batch, self._saved_mu)
        return self.batch

    def _process(self, b: SamplingBatch, logits: torch.Tensor, seqs: list[Sequence],
                 bitmask: torch.Tensor | None) -> torch.Tensor:
        """logits [S, V] -> the logits each row draws from: after bias, penalties and masks, then
        (sampled rows only: greedy rows take the argmax, which no filter changes) its chain.
        Works in place on one copy: on CPU each fresh [S, V] tensor costs a page fault per page."""
        x = logits.clone()  # the raw logits stay for raw logprobs
        state = b.state
        if b.logit_bias is not None:
            rows, ids, values = b.logit_bias
            x.index_put_((rows, ids), values, accumulate=True)
        if b.repetition is not None:
            seen = _select(state.seen, b.repetition.rows)
            x = _on_rows(x, b.repetition, lambda sub, v: penalties.apply_sign_aware_penalty(sub, seen, v))
        # The multiplicative penalties before the subtractive ones, as llama.cpp's penalties sampler
        # (divide or multiply by repeat, then subtract frequency and presence) and vLLM do: the
        # other way round the repeat penalty would scale the presence/frequency amounts too.
        if b.repeat is not None:
            in_window = _select(state.window_counts, b.repeat.rows) > 0
            x = _on_rows(x, b.repeat, lambda sub, v: penalties.apply_sign_aware_penalty(sub, in_window, v))
        if b.presence_frequency is not None:
            counts = _select(state.output_counts, b.presence_frequency.rows)
            x = _on_rows(x, b.presence_frequency,
                         lambda sub, v: penalties.apply_presence_frequency(sub, counts, v[:, :1], v[:, 1:]))
        if b.dry is not None:
            x = self._apply_dry(b, x)
        x = self._apply_masks(b, x, seqs, bitmask)
        for step in b.chain:
            x = _on_rows(x, step.on, self._filter(b, step))
        if b.mirostat is not None:
            x = _on_rows(x, b.mirostat,
                         lambda sub, v: sub.masked_fill_(processors.mirostat_v2_removed(sub, b.mirostat_mu), NEG_INF))
        return x

    def _filter(self, b: SamplingBatch, step: FilterStep) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The step as an in-place function of (logits of its rows [R, V], their values [R, C])."""
        name = step.name
        if name == "temperature":
            return lambda sub, v: sub.div_(v)
        if name == "top_k":
            def removed(sub: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return processors.top_k_removed(sub, v, step.on.limit)
        elif name == "xtc":
            rows = step.on.rows
            keys = row_keys(*(_select(t, rows) for t in (b.seed_lo, b.seed_hi, b.sample_index, b.state.num_output)),
                            stream=STREAM_XTC)
            coin = uniforms(keys, self._columns[:1])  # [R, 1]: one uniform per row and step

            def removed(sub: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return processors.xtc_removed(sub, v[:, :1], coin < v[:, 1:])
        elif name == "top_p":
            removed = self._top_p_removed
        else:
            removed = _REMOVED[name]
        return lambda sub, v: sub.masked_fill_(removed(sub, v), NEG_INF)

    def _apply_masks(self, b: SamplingBatch, x: torch.Tensor, seqs: list[Sequence],
                     bitmask: torch.Tensor | None) -> torch.Tensor:
        if b.allowed_rows is not None:
            x.index_copy_(0, b.allowed_rows, x.index_select(0, b.allowed_rows).masked_fill(~b.allowed_mask, NEG_INF))
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, prefix, last in b.bad_word_prefixes:  # host-side: the output's tail is a Python list
            output = seqs[row].output_token_ids
            if len(output) >= len(prefix) and tuple(output[len(output) - len(prefix):]) == prefix:
                banned_rows.append(row)
                banned_ids.append(last)
        if b.banned is not None:
            x.index_put_(b.banned, x.new_full((), NEG_INF))
        if banned_rows:
            x.index_put_((tensor_on(x.device, banned_rows, torch.long), tensor_on(x.device, banned_ids, torch.long)),
                         x.new_full((), NEG_INF))
        if b.stop_ids is not None:
            rows, ids = b.stop_ids
            active = b.state.num_output.index_select(0, rows) < b.min_tokens.index_select(0, rows)
            x.index_put_((rows, ids), torch.where(active, NEG_INF, x[rows, ids]))
        if bitmask is not None:
            processors.apply_token_bitmask_(x, bitmask)
        return x

    def _apply_dry(self, b: SamplingBatch, x: torch.Tensor) -> torch.Tensor:
        dry = b.dry
        state = b.state
        width = state.max_num_tokens if dry.max_last_n == 0 else min(dry.max_last_n, state.max_num_tokens)
        window, valid = state.windows(dry.rows, dry.last_n, width)  # [D, width]
        rep_limit = penalties.dry_rep_limit(window, valid, dry.breakers)
        ids, amounts = penalties.dry_penalties(window, valid, rep_limit, dry.multiplier, dry.base, dry.allowed_length,
                                               dry.max_exponent, dry.single_breakers, dry.max_match, x.shape[-1])
        return x.index_copy_(0, dry.rows, penalties.subtract_at(x.index_select(0, dry.rows), ids, amounts))

    def _draw(self, b: SamplingBatch, final: torch.Tensor) -> torch.Tensor:
        if not b.any_sampled:
            return self._argmax(final)
        rows = b.sampled_rows  # greedy rows need no noise
        keys = row_keys(*(_select(t, rows) for t in (b.seed_lo, b.seed_hi, b.sample_index, b.state.num_output)),
                        stream=STREAM_TOKEN)
        # Gumbel-max over a hashed uniform per logit. One uniform per row with an inverse CDF is
        # ~8x cheaper (2.2 vs 17 ms at 32 x 49152) but less robust to the forward's batch-shape
        # rounding (bf16 logits move in the last bits with the batch): the cumulative sum carries
        # every logit's change, while a Gumbel flip needs the top two noisy scores within it. The
        # same 5000-request seeded soak (bench/soak.py --tiny) replayed 3 of 4566 outputs
        # differently with the inverse CDF and none with this.
        sampled = _select(final, rows)
        if self._gumbel_argmax is not None:  # one pass, no [S, V] noise: 2.9 -> 0.9 ms at 32 x 49152
            sampled_ids = self._gumbel_argmax(sampled.contiguous(), keys, self._columns)
        else:
            sampled_ids = gumbel_noise(keys, self._columns).add_(sampled).argmax(dim=-1)
        token_ids = sampled_ids if rows is None else self._argmax(final).index_copy(0, rows, sampled_ids)
        if b.mirostat is not None:
            on = b.mirostat
            chosen_ids = _select(token_ids, on.rows)[:, None]
            chosen = _select(final, on.rows).log_softmax(dim=-1).gather(-1, chosen_ids)  # [R, 1]
            b.mirostat_mu = processors.mirostat_v2_update(b.mirostat_mu, chosen, on.values[:, :1], on.values[:, 1:])
        return token_ids

    def _logprobs(self, b: SamplingBatch, logits: torch.Tensor, final: torch.Tensor | None,
                  token_ids: torch.Tensor) -> SamplerOutput:
        if not b.want_chosen and b.max_top_logprobs == 0:
            return SamplerOutput(token_ids, None, None, None, None)
        index = token_ids[:, None]
        # Raw logprobs are always wanted here: cumulative_logprob is raw whatever the mode.
        raw = logits.log_softmax(dim=-1)  # [S, V]
        raw_chosen = raw.gather(-1, index)[:, 0]
        k = b.max_top_logprobs
        top_lps, top_ids = processors.topk_lowest_id_first(raw, k) if k > 0 else (None, None)
        if b.processed_logprobs is None:
            return SamplerOutput(token_ids, raw_chosen, raw_chosen, top_ids, top_lps)
        processed = final.log_softmax(dim=-1)  # [S, V]; greedy rows: penalties and masks only
        pick = b.processed_logprobs  # [S]
        chosen = torch.where(pick, processed.gather(-1, index)[:, 0], raw_chosen)
        if k > 0:
            proc_lps, proc_ids = processors.topk_lowest_id_first(processed, k)
            top_lps = torch.where(pick[:, None], proc_lps, top_lps)
            top_ids = torch.where(pick[:, None], proc_ids, top_ids)
        return SamplerOutput(token_ids, chosen, raw_chosen, top_ids, top_lps)


_REMOVED = {  # top_p: Sampler._top_p_removed (with the CPU kernel)
    "min_p": processors.min_p_removed,
    "typical_p": processors.typical_p_removed,
    "top_n_sigma": processors.top_n_sigma_removed,
}


def _select(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t.index_select(0, rows)


def _on_rows(x: torch.Tensor, on: RowParams,
             fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Applies fn to the rows that use a step only: x [S, V] -> x with those rows replaced (in
    place when fn works in place)."""
    if on.rows is None:
        return fn(x, on.values)
    return x.index_copy_(0, on.rows, fn(x.index_select(0, on.rows), on.values))

