"""Paged attention over one ragged step: prefill chunks one by one, all decodes in one call.

Shared by every native architecture (llama.py, gpt2.py); reads the keys and values the layer
already wrote into the PagedKVCache, through the block tables in AttentionMetadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_worker.attention_metadata import AttentionMetadata
from model_worker.kv_cache import PagedKVCache


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                    kv: PagedKVCache, scale: float, sliding: bool = False) -> torch.Tensor:
    """q [T, H, D], this step's k/v [T, Hkv, D] (already in the cache) -> [T, H * D].
    sliding: this layer attends only within meta.sliding_window (its window masks)."""
    num_tokens, num_heads, head_dim = q.shape
    k_cache, v_cache = kv.layer_keys[layer], kv.layer_values[layer]  # [num_blocks, block_size, Hkv, D]
    d = meta.decode
    if not meta.prefills and kv.decode_kernel is not None and d is not None and d.block_tables.shape[0] == num_tokens:
        # A decode-only step, as most steps are: the kernel's output is the whole answer, with
        # no buffer to fill (at one stream the buffer and its copy cost more than half as much
        # as the kernel itself).
        window = meta.sliding_window if sliding and d.window_mask is not None else 0
        return kv.decode_kernel(q, k_cache, v_cache, d.block_tables, d.seq_lens, window,
                                scale).view(num_tokens, num_heads * head_dim)
    num_kv_heads = k.shape[1]
    gqa = num_kv_heads != num_heads
    out = q.new_empty(q.shape)  # [T, H, D], contiguous whatever q's strides (GPT-2 slices one qkv)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_tokens)
        query = q[rows].transpose(0, 1)[None]  # [1, H, n, D]
        if seg.block_ids is None:
            # Nothing cached before this chunk: its own keys are all it attends to.
            keys = k[rows].transpose(0, 1)[None]  # [1, Hkv, n, D]
            values = v[rows].transpose(0, 1)[None]
        else:
            end = seg.context_len + seg.num_tokens
            # [nb, block_size, Hkv, D] -> [nb * block_size, Hkv, D] -> first `end` positions
            keys = k_cache.index_select(0, seg.block_ids).flatten(0, 1)[:end].transpose(0, 1)[None]
            values = v_cache.index_select(0, seg.block_ids).flatten(0, 1)[:end].transpose(0, 1)[None]
        mask = seg.window_mask if sliding and seg.window_mask is not None else seg.mask
        o = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa,
        )  # [1, H, n, D]
        out[rows] = o[0].transpose(0, 1)
    if d is not None and kv.decode_kernel is not None:
        # Reads the cache in place through the block tables (model_worker/kernels), where the
        # torch-ops path below copies every sequence's keys and values twice first.
        batch = d.block_tables.shape[0]
        window = meta.sliding_window if sliding and d.window_mask is not None else 0
        out[d.start:d.start + batch] = kv.decode_kernel(q[d.start:d.start + batch], k_cache, v_cache, d.block_tables,
                                                        d.seq_lens, window, scale)
    elif d is not None:
        batch, max_blocks = d.block_tables.shape
        query = q[d.start:d.start + batch][:, :, None, :]  # [B, H, 1, D]
        # One index_select over all sequences' blocks, then a strided view [B, Hkv, L, D]:
        # token-major blocks need no copy after the gather (see kv_cache.PagedKVCache).
        flat = d.block_tables.view(-1)
        length = max_blocks * kv.block_size
        keys = k_cache.index_select(0, flat).view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
        if query.device.type == "cpu" and query.dtype != torch.float32:
            # torch's CPU SDPA kernel is ~8x slower in bf16 than in float32 for one-token
            # queries with a mask (8.5 vs 1.0 ms at B=32, L=144, measured); the upcast
            # costs far less than that.
            query, keys, values = query.float(), keys.float(), values.float()
        mask = d.window_mask if sliding and d.window_mask is not None else d.mask
        o = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa,
        )  # [B, H, 1, D]
        out[d.start:d.start + batch] = o[:, :, 0, :]
    return out.view(num_tokens, num_heads * head_dim)
