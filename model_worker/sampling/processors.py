"""Pure logits filters and warpers on [S, V] float32 logits with per-row parameters [S, 1].

Each `*_removed` returns the [S, V] bool mask of the tokens it drops; the sampler sets them to
-inf in place (as transformers' warpers do), so a later softmax gives them probability 0 and argmax
never picks them; `top_k(...)` etc. return the filtered copy. A filter's neutral value (top_k 0,
top_p 1, min_p 0, ...) keeps its row whole. Used by sampler.py in either chain order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """temperature [S, 1] > 0 (1 for greedy rows: their argmax does not change)."""
    return logits / temperature


def top_k_removed(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """k [S, 1] long, 0: off. Ties with the k-th logit stay, as in transformers' TopKLogitsWarper."""
    # topk of the batch's largest k, not a full sort: k is usually far below V.
    top_values = logits.topk(max_k, dim=-1).values  # [S, max_k]
    kth = top_values.gather(-1, (k - 1).clamp(min=0, max=max_k - 1))  # [S, 1]
    remove = (logits < kth) & (k > 0)
    return remove


def _num_candidates(logits: torch.Tensor) -> int | None:
    """How many tokens any row still has in play, when that is few enough (an earlier top_k left
    them) that sorting only those beats sorting the vocabulary; None otherwise. The tokens left
    out are -inf, so they add nothing to any softmax or cumulative mass. Always None on an
    accelerator: reading the count back would make the host wait for the device mid-step, and a
    full sort there costs less than that wait."""
    if logits.device.type != "cpu":
        return None
    count = int(torch.isfinite(logits).sum(dim=-1).max())
    return count if 0 < count <= logits.shape[-1] // 4 else None  # 0: all -inf, nothing to sort by


# top_p on CPU looks for each row's cut in two cheaper ways before it sorts the whole vocabulary:
# among the row's 64 largest logits, which settles most rows of confident text (SmolLM2 answering
# chat prompts at temperature 1: the nucleus of p 0.9 held <= 64 tokens at 90% of 310 positions,
# of p 0.95 at 74%), then within a band of logit values found from a histogram, which settles the
# flat rows (after the benchmarks' random-word prompts, p 0.95's nucleus held > 1024 tokens at 44%
# of 800 positions, up to 17932).
TOP_P_CANDIDATES = 64
TOP_P_BIN_WIDTH = 1 / 32  # in logits: the histogram's bins run down from the row's largest logit
TOP_P_NUM_BINS = 2048  # 64 logits deep; everything lower shares the last bin


def top_p_removed(logits: torch.Tensor, p: torch.Tensor,
                  kernel: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                  ) -> torch.Tensor:
    """p [S, 1] in (0, 1], 1: off. Keeps the most likely tokens until their mass reaches p (the
    first is always kept), computed as transformers' TopPLogitsWarper does so the kept sets match:
    ascending sort, drop while the cumulative mass is <= 1 - p (1 - p rounded from float64, as a
    Python scalar would be). They can differ at exact ties, which transformers' unstable sort
    orders as it happens to, and, on CPU, by the token at the cut when its cumulative mass is
    within the float32 softmax's rounding of 1 - p (~1e-5 here): the softmax's sum runs over the
    row unsorted.

    On CPU each row's cut is first looked for among a few of its tokens, and only rows where that
    does not settle it are sorted whole: a full sort of 32 rows of 49152 took 56 ms on 2 cores,
    2.5 times a decode step. kernel: sampling_ops.cpp's top_p_rows, which does the band's work in
    one call (float32 logits; else the torch ops below). On an accelerator the full sort stays:
    choosing rows would make the host wait for the device mid-step."""
    if logits.device.type != "cpu":
        return _top_p_removed_by_full_sort(logits, p)
    remove = torch.zeros_like(logits, dtype=torch.bool)
    rows = (p[:, 0] < 1.0).nonzero()[:, 0]
    every_row = rows.numel() == logits.shape[0]
    row_logits, row_p = (logits, p) if every_row else (logits.index_select(0, rows), p.index_select(0, rows))
    if kernel is not None and logits.dtype == torch.float32:
        stages = [lambda x, q: kernel(x.contiguous(), q[:, 0].contiguous())]
    else:
        stages = [_top_p_removed_among_largest, _top_p_removed_in_band]
    for settle in stages:
        if rows.numel() == 0:
            return remove
        row_remove, settled = settle(row_logits, row_p)
        if every_row and bool(settled.all()):
            return row_remove
        if bool(settled.any()):
            remove.index_copy_(0, rows[settled], row_remove[settled])
            every_row, left = False, ~settled
            rows, row_logits, row_p = rows[left], row_logits[left], row_p[left]
    if rows.numel() > 0:
        remove.index_copy_(0, rows, _top_p_removed_by_full_sort(row_logits, row_p))
    return remove


def _softmax_and_total(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' softmax [S, V] and its float64 sum [S, 1]."""
    probs = logits.softmax(dim=-1)
    return probs, probs.sum(dim=-1, keepdim=True, dtype=torch.float64)


def _tie_ordered_descending(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the given token ids [S, n], sorted by descending logit with ties by
    ascending id: the order a stable descending sort of the whole row gives them."""
    ids = ids.sort(dim=-1).values
    values, by_value = logits.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, by_value)


def _top_p_cut(candidate_probs: torch.Tensor, mass_above: torch.Tensor, total: torch.Tensor,
               p: torch.Tensor) -> torch.Tensor:
    """remove [S, n] for a run of candidates, in descending order, with every token above them
    (mass_above [S, 1], float64) and none between them and the rest. transformers' float32 cumsum
    adds in float64 on CPU and rounds each sum to float32, so the mass up to and including a
    candidate, in ascending order, is the row's float64 total less what lies above it, rounded."""
    candidate_probs = candidate_probs.double()
    above = mass_above + candidate_probs.cumsum(dim=-1) - candidate_probs
    return _dropped(total - above, p)


def _dropped(cumulative: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """transformers' test on a float64 cumulative mass: rounded to float32, <= 1 - p (rounded from float64)."""
    return cumulative.to(torch.float32) <= (1.0 - p.double()).to(torch.float32)


def _top_p_removed_among_largest(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(remove [S, V], settled [S]): top_p's mask from each row's TOP_P_CANDIDATES largest logits,
    valid for the rows where it is settled: the smallest candidate, with every candidate tied to
    it, is dropped. Every token with a larger logit is a candidate, so everything below is dropped
    too, whatever its order among ties with the candidates."""
    probs, total = _softmax_and_total(logits)
    count = min(TOP_P_CANDIDATES, logits.shape[-1])
    values, ids = _tie_ordered_descending(logits, logits.topk(count, dim=-1).indices)
    remove_sorted = _top_p_cut(probs.gather(-1, ids), torch.zeros_like(total), total, p)
    remove_sorted[:, 0] = False
    settled = (remove_sorted | (values > values[:, -1:])).all(dim=-1) & torch.isfinite(total[:, 0])
    return torch.ones_like(logits, dtype=torch.bool).scatter_(-1, ids, remove_sorted), settled


def _top_p_removed_in_band(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(remove [S, V], settled [S]) as _top_p_removed_among_largest, from a band of logit values:
    a histogram of each row's probability mass over TOP_P_BIN_WIDTH bins finds the bin where the
    mass reaches p, and the band is that bin and its two neighbours. Bins split strictly by value,
    so ties never straddle the band's edges; only the band's tokens are sorted. A row is settled
    when the band's first token is kept (or is the row's top) and the token right below it, whose
    mass above is everything above the band plus the band, is dropped."""
    probs, total = _softmax_and_total(logits)
    num_rows, vocab = logits.shape
    bins = ((logits.amax(dim=-1, keepdim=True) - logits) * (1 / TOP_P_BIN_WIDTH))
    # [S, V]; 0: the top; -inf goes to the last bin. A row with a NaN or an infinite max has NaN
    # here and in its softmax; its bins are only kept in range, and the full sort takes it.
    bins = bins.nan_to_num_(nan=0.0).clamp_(max=TOP_P_NUM_BINS - 1).long()
    usable = torch.isfinite(total[:, 0])
    mass = torch.zeros(num_rows, TOP_P_NUM_BINS, dtype=probs.dtype).scatter_add_(1, bins, probs)
    # The first bin where the mass reaches p (float32 is close enough to choose a band).
    cut = (mass.cumsum(dim=1) < p.to(probs.dtype) * total.to(probs.dtype)).sum(dim=1, keepdim=True)
    first, last = (cut - 1).clamp(min=0), (cut + 1).clamp(max=TOP_P_NUM_BINS - 1)
    in_band = (bins >= first) & (bins <= last)
    # A band of much of the row (a flat row: most tokens within a bin's width) would cost what the
    # full sort does and widen every row's padding below; the full sort takes such rows.
    usable &= in_band.sum(dim=-1) <= vocab // 8
    in_band &= usable[:, None]
    if not bool(usable.any()):
        return torch.ones_like(logits, dtype=torch.bool), usable
    mass_above = torch.where(bins < first, probs, 0.0).sum(dim=-1, keepdim=True, dtype=torch.float64)
    rows, ids = in_band.nonzero(as_tuple=True)  # ids ascending per row
    counts = torch.bincount(rows, minlength=num_rows)
    width = max(int(counts.max()), 1)
    slot = torch.arange(rows.numel()) - (counts.cumsum(0) - counts)[rows]
    padding = torch.arange(width)[None, :] >= counts[:, None]  # [S, width]
    values = torch.full((num_rows, width), NEG_INF, dtype=logits.dtype).index_put_((rows, slot), logits[rows, ids])
    band_ids = torch.zeros_like(padding, dtype=torch.long).index_put_((rows, slot), ids)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)  # ties: ascending id
    band_ids = band_ids.gather(-1, by_value)
    band_ids = torch.where(padding, band_ids[:, :1], band_ids)  # padding repeats the first token
    band_probs = torch.where(padding, 0.0, probs.gather(-1, band_ids))
    remove_band = _top_p_cut(band_probs, mass_above, total, p)
    remove_band[:, 0] &= first[:, 0] > 0  # the row's top token always stays
    below_dropped = _dropped(total - mass_above - band_probs.double().sum(dim=-1, keepdim=True), p)[:, 0]
    settled = usable & ~remove_band[:, 0] & below_dropped
    remove_band = torch.where(padding, remove_band[:, :1], remove_band)
    return (bins > last).scatter_(-1, band_ids, remove_band), settled


def _top_p_removed_by_full_sort(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    count = _num_candidates(logits)
    # Ties are ordered by descending token id on every path, so that of tied tokens at the cut the
    # lowest id stays (as argmax picks it) and a row's kept set does not depend on which path the
    # rest of the batch chose.
    if count is None:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [S, V]
    else:
        sorted_logits, order = _tie_ordered_descending(logits, logits.topk(count, dim=-1).indices)
    sorted_logits, order = sorted_logits.flip(-1), order.flip(-1)  # ascending values
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1.0 - p.double()).to(logits.dtype)
    remove_sorted[:, -1] = False
    remove_sorted &= p < 1.0
    return torch.ones_like(logits, dtype=torch.bool).scatter_(-1, order, remove_sorted)


def min_p_removed(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """p [S, 1] in [0, 1], 0: off. Drops tokens with probability < p * the top probability;
    compared in log space (logit < max + log p), so no softmax is needed."""
    max_logit = logits.amax(dim=-1, keepdim=True)
    # log(0) = -inf removes nothing; the top token stays even for p > 1 (as llama.cpp's min_keep).
    remove = (logits < max_logit + torch.log(p)) & (logits < max_logit)
    return remove


def typical_p_removed(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """mass [S, 1] in (0, 1], 1: off. Locally typical sampling (Meister et al.), as transformers'
    TypicalLogitsWarper: keep the tokens whose surprise is closest to the entropy, until `mass`."""
    log_probs = logits.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)  # -inf * 0 = nan for removed tokens
    shifted = (-log_probs - entropy).abs()  # [S, V]
    count = _num_candidates(logits)
    if count is None:
        sorted_shifted, order = shifted.sort(dim=-1)
    else:  # the -inf tokens have shifted = inf: the `count` smallest are the candidates
        sorted_shifted, order = shifted.topk(count, dim=-1, largest=False)
    cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=order.shape[-1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(-1, last)
    remove_sorted[:, 0] = False
    remove_sorted &= mass < 1.0
    # Tokens outside `order` are -inf already: removing them again changes nothing.
    return torch.ones_like(logits, dtype=torch.bool).scatter_(-1, order, remove_sorted)


def top_n_sigma_removed(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """n [S, 1], <= 0: off. Keeps logits >= max - n * std, with mean and (population) std over the
    tokens still in play, as llama.cpp's top-n-sigma."""
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    zeroed = torch.where(finite, logits, 0.0)
    mean = zeroed.sum(dim=-1, keepdim=True) / count
    var = torch.where(finite, (logits - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
    max_logit = logits.amax(dim=-1, keepdim=True)
    remove = (logits < max_logit - n * var.sqrt()) & (n > 0)
    return remove


def xtc_removed(logits: torch.Tensor, threshold: torch.Tensor, applies: torch.Tensor) -> torch.Tensor:
    """Exclude Top Choices (llama.cpp): where `applies` [S, 1] (the row's coin came up) and at least
    two tokens have probability >= threshold [S, 1], drop all of them but the least likely one.
    A threshold above 0.5 can never have two such tokens, so it is off (llama.cpp returns early)."""
    probs = logits.softmax(dim=-1)
    above = (probs >= threshold) & (probs > 0)  # tokens already filtered out are not candidates
    least_above = torch.where(above, probs, math.inf).amin(dim=-1, keepdim=True)
    active = applies & (above.sum(dim=-1, keepdim=True) >= 2) & (threshold <= 0.5)
    remove = above & (probs > least_above) & active
    return remove


def mirostat_v2_removed(logits: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """mu [S, 1]: keep tokens whose surprise -log2(p) is at most mu, and always the top one."""
    surprise = -logits.log_softmax(dim=-1) / math.log(2.0)
    remove = (surprise > mu) & (logits < logits.amax(dim=-1, keepdim=True))
    return remove


def filtered(logits: torch.Tensor, remove: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(remove, NEG_INF)


def top_k(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    return filtered(logits, top_k_removed(logits, k, max_k))


def top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return filtered(logits, top_p_removed(logits, p))


def min_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return filtered(logits, min_p_removed(logits, p))


def typical_p(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    return filtered(logits, typical_p_removed(logits, mass))


def top_n_sigma(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return filtered(logits, top_n_sigma_removed(logits, n))


def xtc(logits: torch.Tensor, threshold: torch.Tensor, applies: torch.Tensor) -> torch.Tensor:
    return filtered(logits, xtc_removed(logits, threshold, applies))


def mirostat_v2(logits: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    return filtered(logits, mirostat_v2_removed(logits, mu))


def mirostat_v2_update(mu: torch.Tensor, chosen_log_prob: torch.Tensor, tau: torch.Tensor,
                       eta: torch.Tensor) -> torch.Tensor:
    """mu, tau, eta [S, 1]; chosen_log_prob [S, 1] natural log of the drawn token's probability in
    the truncated distribution -> next mu = mu - eta * (observed surprise - tau)."""
    observed = -chosen_log_prob / math.log(2.0)
    return mu - eta * (observed - tau)


def _topk_of_packed_keys(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, V] float32 -> its k largest values per row and their ids, equal values lowest id
    first, from one topk over int64 keys: the value's float32 bits, made to order as the floats
    do, in the high half, and V - 1 - id in the low half, so a larger key is a larger value or
    an equal value at a lower id. -0.0 counts as 0.0, as the float comparison does."""
    num_ids = x.shape[-1]
    bits = (x.float() + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 becomes 0.0
    # Negative floats order backwards as signed integers: flip their magnitude bits.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    low = num_ids - 1 - torch.arange(num_ids, device=x.device)
    ids = ((ordered << 32) | low).topk(min(k, num_ids), dim=-1).indices
    return x.gather(-1, ids), ids


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 -> allowed [R, vocab_size] bool (True: the token may be drawn)."""
    if bitmask.device.type == "cpu":
        # numpy's unpackbits is one C loop over the bytes; the torch form makes [R, 4W, 8] temporaries.
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, count=vocab_size,
                             bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    return unpack_bitmask_torch(bitmask, vocab_size)


def unpack_bitmask_torch(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """unpack_bitmask on any device (CUDA keeps the mask where the logits are)."""
    # Byte view of little-endian int32 words: byte b of word w holds tokens 32w + 8b .. +7,
    # lowest bit first, so unpacking each byte low-to-high keeps token order.
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    bits = (as_bytes[:, :, None] >> _BIT_SHIFTS.to(bitmask.device)) & 1  # [R, 4W, 8]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets logits [S, V] of tokens the bitmask [S, W] does not allow to -inf, in place.

    Only rows with some bit clear are unpacked and written; all-ones (unconstrained) rows are
    not touched. -inf, not finfo.min, so later softmax, top-k and argmax give them exactly 0.
    """
    bitmask = bitmask.to(logits.device, non_blocking=True)
    rows = (bitmask != -1).any(dim=1).nonzero()[:, 0]  # [R]
    if rows.numel() == logits.shape[0]:
        # Unpacking the complement gives the disallowed tokens without a separate negation pass.
        logits.masked_fill_(unpack_bitmask(~bitmask, logits.shape[-1]), float("-inf"))
    elif rows.numel():
        disallowed = unpack_bitmask(~bitmask.index_select(0, rows), logits.shape[-1])  # [R, V]
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(disallowed, float("-inf")))


def masked_by_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] (a new tensor) with -inf for the tokens bitmask [S, W] (xgrammar's layout, bit
    j of word w allowing token 32 * w + j) forbids. A row it leaves empty (a parser in error) keeps
    its logits: its logprobs stay finite, and its matcher refuses the token drawn. On the CPU only
    the constrained rows are unpacked (numpy) and written; elsewhere one pass, with no host sync."""
    bitmask = torch.where((bitmask == 0).all(dim=1, keepdim=True), -1, bitmask.to(logits.device))
    out = logits.clone()  # the caller's logits may be float32 already, and are kept
    if out.device.type == "cpu":
        apply_token_bitmask_(out, bitmask)
    else:
        out.masked_fill_(unpack_bitmask_torch(~bitmask, out.shape[-1]), float("-inf"))
    return out


# Candidates beyond k that topk_lowest_id_first takes, so ties at the k-th place are usually all in.
_TIE_MARGIN = 8


def topk_lowest_id_first(x: torch.Tensor, k: int, packed: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, V] -> (values, ids) [S, k]: x.topk(k) with equal values in ascending id order.

    torch.topk leaves the order of equal values, and which of them make the cut at the k-th
    place, to the kernel, and they changed with k (the batch's largest top_logprobs): with
    bfloat16 logits, where ties are common, a request's top logprobs then depended on what else
    was in its batch. k + _TIE_MARGIN candidates hold every value equal to the k-th unless the
    last candidate equals it too; only such rows pay for a full stable sort.

    packed (default: off the CPU) gives the same answer from one topk over int64 keys, with no
    host sync (finding the rows that need a full sort reads a count back, which the sampler
    avoids on a GPU): see _topk_of_packed_keys.
    """
    if packed is None:
        packed = x.device.type != "cpu"
    if packed:
        return _topk_of_packed_keys(x, k)
    num = min(k + _TIE_MARGIN, x.shape[-1])
    values, ids = x.topk(num, dim=-1)  # [S, num], descending
    spill = (values[:, -1] == values[:, k - 1]).nonzero()[:, 0] if num < x.shape[-1] else ids[:0, 0]
    if spill.numel():
        full_values, full_ids = x[spill].sort(dim=-1, descending=True, stable=True)
        values[spill], ids[spill] = full_values[:, :num], full_ids[:, :num]
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids.gather(-1, by_value[:, :k])
