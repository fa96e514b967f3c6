"""Pure logits filters and warpers on [S, V] float32 logits with per-row parameters [S, 1].

Each `*_removed` returns the [S, V] bool mask of the tokens it drops; the sampler sets them to
-inf in place (as transformers' warpers do), so a later softmax gives them probability 0 and argmax
never picks them; `top_k(...)` etc. return the filtered copy. A filter's neutral value (top_k 0,
top_p 1, min_p 0, ...) keeps its row whole. Used by sampler.py in either chain order.
"""

from __future__ import annotations

import math

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
    return count if count <= logits.shape[-1] // 4 else None


def top_p_removed(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """p [S, 1] in (0, 1], 1: off. Keeps the most likely tokens until their mass reaches p (the
    first is always kept), computed as transformers' TopPLogitsWarper does so the kept sets match
    bit for bit (but for exact ties, which transformers' unstable sort orders as it happens to):
    ascending sort, drop while the cumulative mass is <= 1 - p (1 - p rounded from float64, as a
    Python scalar would be)."""
    count = _num_candidates(logits)
    # Both paths order ties the same way, by descending token id, so that of tied tokens at the
    # cut the lowest id stays (as argmax picks it) and a row's kept set does not depend on which
    # path the rest of the batch chose.
    if count is None:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [S, V]
    else:
        order = logits.topk(count, dim=-1).indices.sort(dim=-1).values  # [S, n], ascending ids
        sorted_logits, by_value = logits.gather(-1, order).sort(dim=-1, descending=True, stable=True)
        order = order.gather(-1, by_value)
    sorted_logits, order = sorted_logits.flip(-1), order.flip(-1)  # ascending values
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1.0 - p.double()).to(logits.dtype)
    remove_sorted[:, -1] = False
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


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [S, ceil(V / 32)] int32, bit j of word w allowing token 32 * w + j (xgrammar's
    layout) -> allowed [S, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


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
