"""Pure penalty math on [S, V] logits: OpenAI presence/frequency, the sign-aware repetition rule
(HF repetition_penalty and llama.cpp repeat_penalty share it, over different token sets), and DRY.

The token counts they read are kept on the device by token_state.py; sampler.py calls these.
"""

from __future__ import annotations

import math

import torch

# log(float32 max): llama.cpp clamps DRY's exponent so base ** exponent stays finite.
_FLOAT_MAX_LOG = 88.7228391


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI: logit -= frequency * count + presence * (count > 0), in place. counts [S, V] float32
    of output tokens, presence and frequency [S, 1]."""
    if logits.device.type != "cpu":
        # Dense on a GPU: nonzero() waits for the device to learn its size, a host sync per step;
        # over [S, V], the seen tokens lose the same as below and the others 0.
        logits -= torch.where(counts > 0, counts * frequency + presence, 0.0)
        return logits
    rows, ids = (counts > 0).nonzero(as_tuple=True)
    logits[rows, ids] -= counts[rows, ids] * frequency[rows, 0] + presence[rows, 0]
    return logits


def apply_sign_aware_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor rule, in place: for seen tokens [S, V] bool, negative
    logits are multiplied by penalty [S, 1] and the others divided by it, so the penalty always
    lowers them."""
    # Only at the seen tokens (a few hundred of a row's vocabulary): the same values as torch.where
    # over [S, V], which took 4-8 ms at 32 x 49152 on 2 cores against ~0.7 ms.
    if logits.device.type != "cpu":  # dense, without nonzero()'s host sync (as above)
        return logits.copy_(torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits))
    rows, ids = seen.nonzero(as_tuple=True)
    values, factor = logits[rows, ids], penalty[rows, 0]
    logits[rows, ids] = torch.where(values < 0, values * factor, values / factor)
    return logits


def dry_max_exponent(base: float) -> int:
    return int(_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


def dry_rep_limit(window: torch.Tensor, valid: torch.Tensor, breakers: torch.Tensor) -> torch.Tensor:
    """How long a repeat may be, as llama.cpp's DRY step 1: the number of tokens after the latest
    sequence breaker in the window (the whole window if none).

    window [S, N] token ids, right-aligned (the last column is the newest token), valid [S, N];
    breakers [S, B, L] token ids, -1 padded (-1 rows unused). -> [S] long.
    """
    rows, n = window.shape
    device = window.device
    positions = torch.arange(n, device=device)
    # For each start position, the end of the longest breaker that starts there (-1: none).
    best_end = torch.full((rows, n), -1, dtype=torch.long, device=device)
    for b in range(breakers.shape[1]):
        seq = breakers[:, b, :]  # [S, L]
        length = (seq >= 0).sum(dim=-1)  # [S]
        match = valid & (length > 0)[:, None]
        for j in range(seq.shape[1]):
            shifted = torch.full_like(window, -2)
            shifted[:, :n - j] = window[:, j:]
            match &= (shifted == seq[:, j:j + 1]) | (j >= length)[:, None]
        end = positions[None, :] + length[:, None] - 1
        match &= end <= n - 1
        best_end = torch.where(match, torch.maximum(best_end, end), best_end)
    has = best_end >= 0
    latest_start = torch.where(has, positions[None, :], -1).amax(dim=-1)  # [S]
    end_at_latest = best_end.gather(-1, latest_start.clamp(min=0)[:, None])[:, 0]
    window_len = valid.sum(dim=-1)
    return torch.where(latest_start >= 0, n - 1 - end_at_latest, window_len)


def dry_penalties(window: torch.Tensor, valid: torch.Tensor, rep_limit: torch.Tensor, multiplier: torch.Tensor,
                  base: torch.Tensor, allowed_length: torch.Tensor, max_exponent: torch.Tensor,
                  single_breakers: torch.Tensor, max_match: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DRY ("Don't Repeat Yourself", llama.cpp semantics), per window position.

    For every earlier position whose preceding tokens repeat the window's newest ones for L >=
    allowed_length tokens, the token that followed there would extend the repeat: it is penalised
    by multiplier * base ** (L - allowed_length), L capped by rep_limit, the largest L per token;
    single-token sequence breakers never are.
    window/valid [D, N]; rep_limit [D]; multiplier/base/allowed_length/max_exponent [D] (0: no
    clamp); single_breakers [D, B] (-1 padded). max_match bounds the loop: past allowed_length +
    the clamp a longer match changes nothing.
    -> (token ids [D, N-1], amounts [D, N-1] to subtract from their logits). Every position of a
    token carries the same amount, so writing them back in any order is deterministic.
    """
    rows, n = window.shape
    # match_len[:, e]: how many tokens ending at position e equal the window's last tokens.
    match_len = torch.zeros(rows, n - 1, dtype=torch.int32, device=window.device)
    alive = torch.ones(rows, n - 1, dtype=torch.bool, device=window.device)
    for m in range(1, min(max_match, n - 1) + 1):
        # Ending at e, the m-th token back is window[e - m + 1], for e = m-1 .. n-2.
        same = window[:, :n - m] == window[:, n - m:n - m + 1]
        ok = same & valid[:, :n - m] & (m <= rep_limit)[:, None]
        alive[:, :m - 1] = False
        alive[:, m - 1:] &= ok
        if not bool(alive.any()):
            break
        match_len += alive
    next_token = window[:, 1:].clamp(min=0)  # [D, N-1]: the token after each end position
    # The longest repeat each token would extend, scattered over the vocabulary and read back at
    # the window's positions (sparse: only tokens in the window can be penalised).
    longest = torch.zeros(rows, vocab_size, dtype=torch.int32, device=window.device)
    longest.scatter_reduce_(-1, next_token, match_len, reduce="amax")
    length = longest.gather(-1, next_token)  # [D, N-1]
    exponent = (length - allowed_length[:, None]).clamp(min=0)
    clamp = max_exponent[:, None]
    exponent = torch.where(clamp > 0, torch.minimum(exponent, clamp), exponent)
    amount = multiplier[:, None] * base[:, None] ** exponent.to(torch.float32)
    exempt = (next_token[:, :, None] == single_breakers[:, None, :]).any(dim=-1)
    penalised = (length >= allowed_length[:, None]) & (length > 0) & ~exempt
    return next_token, torch.where(penalised, amount, 0.0)


def subtract_at(logits: torch.Tensor, ids: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
    """logits [D, V] -= amounts [D, N] at ids [D, N] (each id's amounts equal), in place."""
    return logits.scatter_(-1, ids, logits.gather(-1, ids) - amounts)
