"""Checks one request's SamplingParams against the ranges vLLM accepts; the engine turns the
message into an INVALID_ARGUMENT rejection before the request is queued."""

from __future__ import annotations

import math

from model_worker.sequence import LogprobsMode, SamplerOrder, SamplingParams

_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's and vLLM's range for logit_bias values
# The sampler's tensors are float32: a value past its range is inf there (a temperature of 1e39
# drew token 0 outside allowed_token_ids, review 100).
_FLOAT32_MAX = 3.4028234663852886e38
# The least penalty divisor: a logit of ~100 over a smaller one overflows float32 (1e-300 became 0
# there, and every seen token's logit inf: the lowest such id drawn whatever the seed, review 100).
_MIN_PENALTY = 1e-30


def _finite(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= _FLOAT32_MAX


def _ids_outside(ids, vocab_size: int) -> int | None:
    return next((t for t in ids if not 0 <= t < vocab_size), None)


def validate_sampling_params(p: SamplingParams, vocab_size: int, max_tokens: int,
                             max_logprobs: int | None = None) -> tuple[str, str] | None:
    """The first problem with p, as (a message a client can act on, the AddRequest field at fault:
    `sampling.<name>` for a SamplingParams field, `top_logprobs` / `prompt_logprobs` /
    `logprobs_mode` for AddRequest's own), or None when p is valid. max_tokens is the request's
    resolved output budget (min_tokens may not exceed it); max_logprobs the most top_logprobs and
    prompt_logprobs allowed (None: the vocabulary)."""
    most = vocab_size if max_logprobs is None else min(max_logprobs, vocab_size)
    limit = "" if most == vocab_size else " (the model worker's --max-logprobs)"
    checks: list[tuple[bool, str, str]] = [  # (valid, AddRequest field, message)
        (_finite(p.temperature) and p.temperature >= 0,
         "sampling.temperature", f"temperature must be >= 0 and finite in float32, not {p.temperature}"),
        (0 <= p.top_k, "sampling.top_k", f"top_k must be >= 0 (0 disables it), not {p.top_k}"),
        (0.0 < p.top_p <= 1.0, "sampling.top_p", f"top_p must be in (0, 1] (0 disables it), not {p.top_p}"),
        (0.0 <= p.min_p <= 1.0, "sampling.min_p", f"min_p must be in [0, 1], not {p.min_p}"),
        (0.0 < p.typical_p <= 1.0,
         "sampling.typical_p", f"typical_p must be in (0, 1] (0 or 1 disables it), not {p.typical_p}"),
        (_finite(p.top_n_sigma),
         "sampling.top_n_sigma", f"top_n_sigma must be a finite number (<= 0 disables it), not {p.top_n_sigma}"),
        (0.0 <= p.xtc_threshold <= 1.0,
         "sampling.xtc_threshold", f"xtc_threshold must be in [0, 1], not {p.xtc_threshold}"),
        (0.0 <= p.xtc_probability <= 1.0,
         "sampling.xtc_probability", f"xtc_probability must be in [0, 1], not {p.xtc_probability}"),
        (_finite(p.dry_multiplier) and p.dry_multiplier >= 0,
         "sampling.dry_multiplier", f"dry_multiplier must be >= 0 (0 disables DRY), not {p.dry_multiplier}"),
        (_finite(p.dry_base) and p.dry_base >= 1.0, "sampling.dry_base", f"dry_base must be >= 1, not {p.dry_base}"),
        (p.dry_allowed_length >= 1,
         "sampling.dry_allowed_length", f"dry_allowed_length must be >= 1, not {p.dry_allowed_length}"),
        (p.dry_penalty_last_n >= -1,
         "sampling.dry_penalty_last_n", f"dry_penalty_last_n must be >= -1 (-1: the whole context, 0: off), not {p.dry_penalty_last_n}"),
        (p.mirostat in (0, 2),
         "sampling.mirostat", f"mirostat must be 0 (off) or 2 (mirostat v2; v1 is not supported), not {p.mirostat}"),
        (_finite(p.mirostat_tau) and p.mirostat_tau > 0,
         "sampling.mirostat_tau", f"mirostat_tau must be > 0, not {p.mirostat_tau}"),
        (0.0 < p.mirostat_eta <= 1.0,
         "sampling.mirostat_eta", f"mirostat_eta must be in (0, 1], not {p.mirostat_eta}"),
        (-2.0 <= p.presence_penalty <= 2.0,
         "sampling.presence_penalty", f"presence_penalty must be in [-2, 2], not {p.presence_penalty}"),
        (-2.0 <= p.frequency_penalty <= 2.0,
         "sampling.frequency_penalty", f"frequency_penalty must be in [-2, 2], not {p.frequency_penalty}"),
        (_finite(p.repetition_penalty) and p.repetition_penalty >= _MIN_PENALTY, "sampling.repetition_penalty",
         f"repetition_penalty must be >= {_MIN_PENALTY:g} (0 or 1 disables it), not {p.repetition_penalty}"),
        (_finite(p.repeat_penalty) and p.repeat_penalty >= _MIN_PENALTY, "sampling.repeat_penalty",
         f"repeat_penalty must be >= {_MIN_PENALTY:g} (0 or 1 disables it), not {p.repeat_penalty}"),
        (p.penalty_last_n >= -1,
         "sampling.penalty_last_n", f"penalty_last_n must be >= -1 (-1: the whole context), not {p.penalty_last_n}"),
        (p.min_tokens >= 0, "sampling.min_tokens", f"min_tokens must be >= 0, not {p.min_tokens}"),
        (p.min_tokens <= max_tokens,
         "sampling.min_tokens", f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({max_tokens})"),
        (0 <= p.top_logprobs <= most,
         "top_logprobs", f"top_logprobs must be in [0, {most}]{limit}, not {p.top_logprobs}"),
        (p.top_logprobs == 0 or p.logprobs,
         "top_logprobs", "top_logprobs needs logprobs set to true (OpenAI's and vLLM's rule)"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= most,
         "prompt_logprobs", f"prompt_logprobs must be in [0, {most}]{limit}, not {p.prompt_logprobs}"),
        (p.sampler_order in tuple(SamplerOrder),
         "sampling.sampler_order", f"unknown sampler_order {p.sampler_order}"),
        (p.logprobs_mode in tuple(LogprobsMode), "logprobs_mode", f"unknown logprobs_mode {p.logprobs_mode}"),
        (p.seed is None or 0 <= p.seed < 2**64, "sampling.seed", f"seed must be in [0, 2**64), not {p.seed}"),
    ]
    for ok, field_name, message in checks:
        if not ok:
            return message, field_name
    for token, bias in p.logit_bias:
        if not 0 <= token < vocab_size:
            return f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", "sampling.logit_bias"
        if not (_finite(bias) and -_LOGIT_BIAS_LIMIT <= bias <= _LOGIT_BIAS_LIMIT):
            return f"logit_bias for token {token} must be in [-100, 100], not {bias}", "sampling.logit_bias"
    for name, sequences in (("bad_words", p.bad_words), ("dry_sequence_breakers", p.dry_sequence_breakers)):
        for seq in sequences:
            if not seq:
                return f"{name} has an empty token sequence", f"sampling.{name}"
            bad = _ids_outside(seq, vocab_size)
            if bad is not None:
                return f"{name} token id {bad} is outside the vocabulary [0, {vocab_size})", f"sampling.{name}"
    bad = _ids_outside(p.allowed_token_ids, vocab_size)
    if bad is not None:
        return (f"allowed_token_ids token id {bad} is outside the vocabulary [0, {vocab_size})",
                "sampling.allowed_token_ids")
    # Every allowed token a one-token bad word: each step's logits would all be -inf, and the draw
    # an arbitrary token outside both (a bad word of more tokens bans only after its prefix).
    if p.allowed_token_ids and {seq[0] for seq in p.bad_words if len(seq) == 1}.issuperset(p.allowed_token_ids):
        return ("bad_words ban every token in allowed_token_ids: no token is left to sample",
                "sampling.allowed_token_ids")
    return None
