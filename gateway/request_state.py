"""One choice's bookkeeping between the two workers: tokens in from the model, text in from detok.

The pipeline keeps one RequestState per output index of a request, records each SequenceTokens
here as the model worker's reader sees it, and turns each TextDelta of the detok worker into the
GenerationEvent the HTTP handler receives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tokenwire.packing import unpack_float32, unpack_int32
from tokenwire.v1 import detok_worker_pb2, model_worker_pb2

FinishReason = model_worker_pb2.FinishReason
_OPENAI_FINISH_REASON = {
    model_worker_pb2.FINISH_REASON_STOP: "stop",
    model_worker_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass
class PromptLogprobs:
    """Each prompt token's logprob and most likely alternatives; the first token has neither."""

    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]
    # Each token's rank by logprob (1: the most likely); 0 where unknown (the first token, a model
    # worker that sends none).
    ranks: list[int] = field(default_factory=list)


# OpenAI's logprobs are finite numbers: a token the model worker's mask ruled out (a grammar, a
# padded vocabulary) has -inf, which JSON cannot carry; vLLM's API writes -9999.0 for it.
MIN_LOGPROB = -9999.0


def api_logprobs(buf: bytes) -> np.ndarray:
    """Packed float32 logprobs, with -inf as MIN_LOGPROB (a NaN, the first prompt token's, stays)."""
    return np.maximum(unpack_float32(buf), MIN_LOGPROB)


def prompt_logprobs_of(seq: model_worker_pb2.SequenceTokens) -> PromptLogprobs:
    logprobs: list[float | None] = [None if math.isnan(lp) else lp for lp in api_logprobs(seq.prompt_logprobs).tolist()]
    k = seq.num_prompt_top_logprobs
    top: list[list[tuple[int, float]]] = [[] for _ in logprobs]
    if k > 0 and seq.prompt_top_token_ids:
        ids = unpack_int32(seq.prompt_top_token_ids).reshape(-1, k).tolist()  # [num_prompt_tokens, k]
        lps = api_logprobs(seq.prompt_top_logprobs).reshape(-1, k).tolist()
        top = [[(t, lp) for t, lp in zip(row_ids, row_lps, strict=True) if t >= 0]
               for row_ids, row_lps in zip(ids, lps, strict=True)]
    ranks = unpack_int32(seq.prompt_ranks).tolist() if seq.prompt_ranks else []
    return PromptLogprobs(logprobs, top, ranks)


@dataclass
class GenerationEvent:
    """New output of one choice. finish_reason is set on its last event only."""

    text: str
    token_ids: list[int]
    # One per token in token_ids when the request asked for logprobs, else empty.
    logprobs: list[float] = field(default_factory=list)
    # Per token: (token id, logprob) of the most likely alternatives, most likely first.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    # Output tokens that count for usage so far: after a stop string, those up to it.
    num_output_tokens: int = 0
    # Prompt tokens the model worker's prefix cache served (usage.prompt_tokens_details).
    num_cached_prompt_tokens: int = 0
    # On a choice's first event only, when the request asked for prompt logprobs.
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's stop_reason, on the last event: the stop string or stop_token_ids entry that ended the
    # choice; None for eos, a length or anything else.
    stop_reason: int | str | None = None


class RequestState:
    """Tokens the model worker produced for one request and how many the client has seen."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_prompt_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.num_emitted = 0
        # Tokens the detok worker's replies say they cover (TextDelta.num_tokens); 0 from a
        # detok worker that does not count them, and then every received token rides along.
        self.num_accounted = 0
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_events = 0
        # Ids sent to the detok worker to render (render_token_ids), in order, not yet answered.
        self.pending_render_ids: list[int] = []
        # The ids sent to the detok worker for text (int32 LE, all of them), the characters of text
        # the client has been given, and how many characters of the text to come were given
        # already: a sequence whose detok replica was lost opens on another with every id again,
        # and its replayed text is skipped up to where the client is (Pipeline._reopen_elsewhere).
        self.text_ids_sent = bytearray()
        self.num_text_chars = 0
        self.skip_text_chars = 0
        self.model_finish_reason: int = model_worker_pb2.FINISH_REASON_UNSPECIFIED
        self.detok_opened = False
        self.finished = False
        self.stop_reason: int | str | None = None  # see GenerationEvent; set by the pipeline

    @property
    def model_finished(self) -> bool:
        return self.model_finish_reason != model_worker_pb2.FINISH_REASON_UNSPECIFIED

    def record_tokens(self, seq: model_worker_pb2.SequenceTokens) -> None:
        new_ids = unpack_int32(seq.token_ids)
        self.token_ids.extend(new_ids.tolist())
        if seq.logprobs:
            self.logprobs.extend(api_logprobs(seq.logprobs).tolist())
        k = seq.num_top_logprobs
        if k > 0 and seq.top_token_ids:
            top_ids = unpack_int32(seq.top_token_ids).reshape(-1, k).tolist()  # [num_new_tokens, k]
            top_lps = api_logprobs(seq.top_logprobs).reshape(-1, k).tolist()
            self.top_logprobs.extend(list(zip(ids, lps, strict=True)) for ids, lps in zip(top_ids, top_lps, strict=True))
        if seq.num_prompt_tokens:
            self.num_prompt_tokens = seq.num_prompt_tokens
        if seq.num_cached_prompt_tokens:
            self.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        self.model_finish_reason = seq.finish_reason

    def take_event(self, delta: detok_worker_pb2.TextDelta) -> GenerationEvent:
        """The event for a text delta: its text plus the tokens since the last event, up to those
        the detok worker's replies have accounted for (TextDelta.num_tokens).

        Tokens ride with the next text rather than with their own text because the detok worker
        may hold text back (a possible stop string, half a character); after a stop string,
        tokens past it are dropped, as the text past it is.
        """
        self.num_accounted += delta.num_tokens
        end = num_output_tokens = len(self.token_ids)
        if self.num_accounted and not delta.finished:
            end = min(self.num_accounted, end)
        finish_reason = None
        if delta.finished:
            self.finished = True
            if delta.stop_index >= 0:
                num_output_tokens = min(num_output_tokens, delta.num_tokens_to_stop)
                end = max(num_output_tokens, self.num_emitted)
                finish_reason = "stop"
            else:
                finish_reason = _OPENAI_FINISH_REASON.get(self.model_finish_reason, "stop")
        start = self.num_emitted
        self.num_emitted = max(end, start)
        if not delta.finished:
            # What the client has been given so far, not what has arrived from the model worker:
            # its frames may run ahead of the detok worker's replies, and a running usage
            # (continuous_usage_stats) that counted them said 13 tokens on a chunk that ended
            # at the 5th.
            num_output_tokens = self.num_emitted
        self.num_events += 1
        self.num_text_chars += len(delta.text)
        return GenerationEvent(
            text=delta.text,
            token_ids=self.token_ids[start:end],
            logprobs=self.logprobs[start:end],
            top_logprobs=self.top_logprobs[start:end],
            finish_reason=finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=num_output_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            prompt_logprobs=self.prompt_logprobs if self.num_events == 1 else None,
            stop_reason=self.stop_reason if finish_reason == "stop" else None,
        )
