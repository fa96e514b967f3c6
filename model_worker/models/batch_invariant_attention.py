"""Batch-invariant paged attention (--batch-invariant): every token's query alone over exactly
its own context, so its result cannot depend on what else the step holds.

The drop-in alternative to attention.paged_attention (same arguments, same cache reads).
SDPA picks its blocking and KV split from the query count and the key length, so in the
default path a token's output changes with its prefill chunk's size and start and with the
longest context among the decodes it is padded to (bench/batch_invariance_probe.py measures
~2e-7 in float32, ~1e-3 in bfloat16). Here the call for a token at position p is always
SDPA(one query, keys 0..p): the same whether it is prefilled in any chunk or decoded (keys
p - window + 1..p in a sliding-window layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_worker.attention_metadata import AttentionMetadata
from model_worker.kv_cache import PagedKVCache


def per_query_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        kv: PagedKVCache, scale: float, sliding: bool = False) -> torch.Tensor:
    """q [T, H, D], this step's k/v [T, Hkv, D] (already in the cache) -> [T, H * D].
    sliding: this layer attends only within meta.sliding_window."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)  # [T, H, D]
    k_cache, v_cache = kv.key[layer], kv.value[layer]  # [num_blocks, block_size, Hkv, D]
    gqa = k.shape[1] != num_heads
    # One-token queries in bf16 run ~8x slower than float32 in torch's CPU kernel (see
    # paged_attention); every token here is a one-token query, so all of them are upcast.
    upcast = q.device.type == "cpu" and q.dtype != torch.float32
    window = meta.sliding_window if sliding else 0

    def attend(row: int, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """keys/values [>= length, Hkv, D] contiguous, positions 0.. of the row's sequence."""
        query = q[row][None, :, None, :]  # [1, H, 1, D]
        if upcast:
            query = query.float()
        # The query at position length - 1 sees keys from length - window on (all if no window):
        # a slice, not a mask, so the call is the same one whatever the chunk.
        first = max(0, length - window) if window else 0
        o = F.scaled_dot_product_attention(
            query, keys[first:length].transpose(0, 1)[None], values[first:length].transpose(0, 1)[None],
            scale=scale, enable_gqa=gqa,
        )  # [1, H, 1, D]
        out[row] = o[0, :, 0]

    def prepared(x: torch.Tensor) -> torch.Tensor:
        # The same contiguous [L, Hkv, D] layout whether read from the cache or from this step's
        # k/v (bitwise the values the cache holds), so every query sees identical operands.
        return (x.float() if upcast else x).contiguous()

    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_tokens)
        if seg.block_ids is None:
            keys, values = prepared(k[rows]), prepared(v[rows])  # [n, Hkv, D]
        else:
            end = seg.context_len + seg.num_tokens
            keys = prepared(k_cache.index_select(0, seg.block_ids).flatten(0, 1)[:end])  # [end, Hkv, D]
            values = prepared(v_cache.index_select(0, seg.block_ids).flatten(0, 1)[:end])
        for j in range(seg.num_tokens):
            attend(seg.start + j, keys, values, seg.context_len + j + 1)
    if meta.decode is not None:
        d = meta.decode
        block_size = kv.block_size
        # Decode rows' positions are their sequences' cached lengths minus one (the new token).
        for b, position in enumerate(meta.positions[d.start:].tolist()):
            length = position + 1
            blocks = d.block_tables[b, :-(-length // block_size)]  # only this sequence's blocks, no padding
            keys = prepared(k_cache.index_select(0, blocks).flatten(0, 1)[:length])  # [L, Hkv, D]
            values = prepared(v_cache.index_select(0, blocks).flatten(0, 1)[:length])
            attend(d.start + b, keys, values, length)
    return out.view(num_tokens, num_heads * head_dim)
