"""The slower path: any causal LM transformers builds from config.json + safetensors, run by
transformers itself, one forward per sequence per step, each sequence with its own cache.

Used by the model runner for architectures without a native model (llama.py, gpt2.py). The
engine, scheduler and block manager work as for native models, but KV lives in transformers'
per-sequence caches, not in the paged KV cache, so nothing is shared by block:
- prefix caching: the runner reports supports_prefix_caching False and the engine turns it
  off; a chunk that still starts past what its cache holds is recomputed from token 0;
- finish, abort, preemption (recompute): a sequence's cache is dropped at the start of the
  next step once the block manager freed its blocks (block_table empty), after forked samples
  took their copies and before any forward allocates, or at once when the engine runs out of
  work (ModelRunner.engine_idle); a chunk starting at 0 always starts a fresh cache;
- n > 1 forks: a child with no cache copies the cache of a live sequence that holds exactly
  its first `start` tokens (its parent, before this step runs), else recomputes them;
- memory: the block manager still hands out blocks from a budget sized by an estimate of
  transformers' KV bytes per token, so the caches never hold more tokens than that.
"""

from __future__ import annotations

import copy
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_worker.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class HFShape:
    """What the runner needs from a config it does not run natively (sizes for the KV budget)."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    architectures: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict) -> HFShape:
        text = config.get("text_config") or config
        hidden = text.get("hidden_size") or text.get("n_embd") or text.get("d_model")
        num_heads = (text.get("num_attention_heads") or text.get("n_head") or text.get("num_heads")
                     or text.get("n_heads") or 1)
        num_layers = (text.get("num_hidden_layers") or text.get("n_layer") or text.get("num_layers")
                      or text.get("n_layers"))
        if not (text.get("vocab_size") and hidden and num_layers):
            raise ValueError(f"config.json of {config.get('architectures')} has no vocab_size / hidden_size / "
                             "num_hidden_layers that a causal LM would have")
        return cls(
            vocab_size=text["vocab_size"],
            num_layers=num_layers,
            # Falcon spells its KV heads num_kv_heads (n_head_kv in old configs), or has one with
            # multi_query (GPTBigCode too): counted as query heads they made the budget 8-71x too small.
            num_kv_heads=(text.get("num_key_value_heads") or text.get("num_kv_heads") or text.get("n_head_kv")
                          or (1 if text.get("multi_query") else num_heads)),
            head_dim=text.get("head_dim") or hidden // num_heads,
            architectures=list(config.get("architectures") or []),
        )


@dataclass
class CacheBudget:
    """Stands in for PagedKVCache when transformers holds the KV: only the number of blocks the
    block manager may hand out, which bounds the tokens all the caches hold together."""

    num_blocks: int
    block_size: int
    num_bytes: int  # the estimate those blocks stand for


@dataclass
class _SequenceCache:
    seq: Sequence  # the sequence whose tokens [0, num_tokens) the cache holds
    cache: object  # the transformers Cache its last forward returned
    num_tokens: int


CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


class HFCausalLM:
    """A transformers AutoModelForCausalLM plus one cache per live sequence (by seq_id)."""

    def __init__(self, model_dir: Path, shape: HFShape, load_format: str, device: torch.device,
                 dtype: torch.dtype) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.shape = shape
        self.device = device
        self.dtype = dtype
        try:
            if load_format == "dummy":
                with torch.random.fork_rng():  # transformers' own random init, reproducible, RNG left as it was
                    torch.manual_seed(0)
                    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"architectures {shape.architectures} are not run natively, and transformers' "
                             f"AutoModelForCausalLM cannot build them from {model_dir}: {e}") from e
        self.model = model.to(device).eval().requires_grad_(False)
        head = self.model.get_output_embeddings()
        if head is not None:  # the logits' width, should the checkpoint pad its vocabulary
            shape.vocab_size = head.weight.shape[0]
        params = inspect.signature(self.model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in params
        # The forward's cache argument, and the output field it comes back in, by the name this
        # transformers gives it: `cache` in 5.x (past_key_values only through a shim that is to go,
        # and not at all for state-space models: Mamba ignored it and restarted from an empty
        # state every step), past_key_values or Mamba's cache_params in 4.x.
        self._cache_kw = next((kw for kw in CACHE_KEYWORDS if kw in params), None)
        if self._cache_kw is None:
            raise ValueError(f"architectures {shape.architectures}: their forward takes no cache argument this "
                             f"fallback knows ({', '.join(CACHE_KEYWORDS)}), so each step would recompute "
                             "the whole sequence; not supported")
        self._caches: dict[int, _SequenceCache] = {}  # by seq_id
        self.continues_chunks = self._continues_chunks()
        if not self.continues_chunks:
            logger.warning("architectures %s: a forward of several tokens on top of a cache differs from one "
                           "forward of them all (state-space models in transformers); a prefill chunk past the "
                           "first is computed from token 0 (slower, exact)", shape.architectures)

    @torch.inference_mode()
    def _continues_chunks(self) -> bool:
        """Whether 4 tokens forwarded on top of the cache of 4 before them give the logits one
        forward of all 8 gives. Mamba's forward in transformers takes a cache only one token at a
        time: chunked prefill on it read logprobs 0.07 off (the tokens happened to agree).

        The difference is weighed against two yardsticks measured here, not against the logits'
        scale (in bfloat16 a tolerance of 3% of it passed Mamba's 0.10): what the context moves
        (the same 4 tokens forwarded without it), of which a model that continues exactly keeps
        less than 0.1% (tiny Mamba kept 0.8-3%, FalconMamba 18-23%; attention models 0.00%), and
        the dtype's own noise between two batch shapes (the first 4 positions in the 4-token and
        the 8-token forward), which on a GPU in bf16 may be most of an attention model's."""
        ids = torch.arange(1, 9, device=self.device)[None] % self.shape.vocab_size  # [1, 8]
        whole = self.model(input_ids=ids, use_cache=True).logits[0].float()
        first = self.model(input_ids=ids[:, :4], use_cache=True)
        rest = self.model(input_ids=ids[:, 4:], use_cache=True, **{self._cache_kw: getattr(first, self._cache_kw)})
        alone = self.model(input_ids=ids[:, 4:], use_cache=True).logits[0].float()
        chunk_error = float((rest.logits[0].float() - whole[4:]).abs().max())
        context_effect = float((alone - whole[4:]).abs().max())
        shape_noise = float((first.logits[0].float() - whole[:4]).abs().max())
        return chunk_error <= max(1e-3 * context_effect, 4 * shape_noise, 1e-6)

    @property
    def num_cached_sequences(self) -> int:
        return len(self._caches)

    def drop_freed_caches(self) -> None:
        """Drops the caches of sequences whose blocks the block manager freed (finished,
        aborted or preempted: deallocate empties the block table)."""
        for seq_id in [i for i, entry in self._caches.items() if not entry.seq.block_table]:
            del self._caches[seq_id]

    @torch.inference_mode()
    def begin_step(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Before a step's forwards, given (sequence, start) of every chunk: gives each forked
        child a copy of a cache holding its first `start` tokens, taken before anything runs (its
        parent decodes in the same step, or already finished), then drops freed caches."""
        for seq, start in chunks:
            entry = self._caches.get(seq.seq_id)
            if start == 0 or (entry is not None and entry.num_tokens == start):
                continue
            donor = self._find_donor(seq, start)
            if donor is not None:
                self._caches[seq.seq_id] = _SequenceCache(seq, copy.deepcopy(donor.cache), start)
        self.drop_freed_caches()

    def _find_donor(self, seq: Sequence, start: int) -> _SequenceCache | None:
        prefix = seq.token_ids_from(0, start)
        for entry in self._caches.values():
            if entry.num_tokens == start and entry.seq.token_ids_from(0, start) == prefix:
                return entry
        return None

    @torch.inference_mode()
    def forward_chunk(self, seq: Sequence, start: int, num_tokens: int, keep: int) -> torch.Tensor:
        """Computes seq's tokens [start, start + num_tokens) on top of its cache; returns the
        logits [keep, V] float32 of the chunk's last `keep` positions."""
        entry = self._caches.get(seq.seq_id)
        if (start == 0 or entry is None or entry.num_tokens != start
                or (num_tokens > 1 and not self.continues_chunks)):
            # No cache holding exactly the first `start` tokens (or one the model cannot take
            # several tokens on): compute them too.
            entry = _SequenceCache(seq, None, 0)
        token_ids = seq.token_ids_from(entry.num_tokens, start + num_tokens - entry.num_tokens)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        kwargs = {"logits_to_keep": keep} if self._takes_logits_to_keep else {}
        out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_kw: entry.cache}, **kwargs)
        entry.cache = getattr(out, self._cache_kw)
        entry.num_tokens = start + num_tokens
        self._caches[seq.seq_id] = entry
        return out.logits[0, -keep:].float()  # [keep, V]
