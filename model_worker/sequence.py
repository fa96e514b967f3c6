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


class SamplerOrder(enum.IntEnum):
    # Values equal the proto's SamplerOrder.
    DEFAULT = 0  # HF (and vLLM V0): penalties -> temperature -> top_k, top_p, min_p, ...
    LLAMA_CPP = 1  # llama.cpp: penalties -> DRY -> filters -> temperature last


class LogprobsMode(enum.IntEnum):
    # Values equal the proto's LogprobsMode.
    RAW = 0  # the model's own log-softmax
    PROCESSED = 1  # log-softmax of the logits the token was drawn from


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, already resolved to their effective values (the proto's
    "0 means off" and unset fields are mapped by the servicer); validated by the engine."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    typical_p: float = 1.0  # 1: off
    top_n_sigma: float = 0.0  # <= 0: off
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0  # 0: off
    dry_multiplier: float = 0.0  # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context; 0: off
    dry_sequence_breakers: tuple[tuple[int, ...], ...] = ()
    mirostat: int = 0  # 0 off, 2: mirostat v2
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    presence_penalty: float = 0.0  # OpenAI, over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF, over prompt + output; 1: off
    repeat_penalty: float = 1.0  # llama.cpp, over the last penalty_last_n tokens; 1: off
    penalty_last_n: int = 64  # -1: the whole context; 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # empty: every id
    sampler_order: SamplerOrder = SamplerOrder.DEFAULT
    seed: int | None = None  # None: the engine draws a random key per request
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob + k alternatives
    # The chosen token's raw logprob is computed (for cumulative_logprob) even without logprobs:
    # best_of / beam candidates are ranked by it.
    needs_cumulative_logprob: bool = False

    @property
    def greedy(self) -> bool:
        # Below vLLM's epsilon the logits / temperature division overflows float32 (or the
        # temperature rounds to 0), so a "nearly greedy" request would not get the argmax.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def wants_chosen_logprob(self) -> bool:
        return self.logprobs or self.needs_cumulative_logprob


# eq=False: a sequence is itself, not its fields' values. The scheduler finds one in its running
# list (`in`, `remove`), and a field-wise __eq__ per entry passed cost 45 us a finish at 256 running
# (a scratch loop) against ~1 with identity (review 86).
@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # resolved: never beyond the context
    stop_token_ids: frozenset[int]
    # What min_tokens holds off: the stop ids and the model's eos ids, ignore_eos or not (vLLM's
    # rule: an ignore_eos + min_tokens request, the fixed-length benchmark recipe, wrote eos ids).
    min_tokens_held_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose keys and values are in the cache; the rest still need a forward.
    num_computed_tokens: int = 0
    # KV cache blocks holding this sequence's positions, in order (block_manager.py).
    block_table: list[int] = field(default_factory=list)
    # Prompt tokens whose KV came from the prefix cache when the sequence was first admitted.
    num_cached_prompt_tokens: int = 0
    # Set at its first admission: a later one (after a preemption) recomputes what it had.
    was_admitted: bool = False
    # Which of its request's n / best_of samples this is (0-based); keys seeded draws.
    sample_index: int = 0
    # Samples still to fork from this one once its prompt is prefilled (n / best_of - 1).
    num_pending_forks: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    stop_token_id: int | None = None  # set with FinishReason.STOP by a stop token
    # What the hash chain of its full blocks starts from (block_manager.prefix_root): its
    # request's cache salt, so only requests with the same salt share cached blocks.
    prefix_root: bytes = b""

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
