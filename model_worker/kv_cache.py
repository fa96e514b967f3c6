"""The paged KV cache tensors and how many blocks they get.

The block manager (block_manager.py) decides which block each token position lives in; this
file only holds the memory the model reads and writes through those block tables.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# CPU default when neither --kv-cache-memory-bytes nor --kv-cache-tokens is given: 1 GiB
# holds ~23k tokens of SmolLM2-135M in float32 (46 KiB per token) without sizing the cache
# from the machine's RAM, which other processes share.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one token position across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_kv_blocks(bytes_per_token: int, block_size: int, max_num_seqs: int, max_model_len: int,
                  device: torch.device, kv_cache_tokens: int = 0, kv_cache_memory_bytes: int = 0,
                  gpu_memory_utilization: float = 0.9, reserved_bytes: int = 0) -> int:
    """Blocks for the cache, from the first of: a token count, a byte budget, a fraction of
    free CUDA memory (call after the weights are loaded), or DEFAULT_CPU_KV_CACHE_BYTES on CPU.
    Never more than max_num_seqs full contexts need; never too few for one full context.
    reserved_bytes (CUDA fraction only): memory kept for something else, e.g. CUDA graphs."""
    if kv_cache_tokens:
        tokens = kv_cache_tokens
    elif kv_cache_memory_bytes:
        tokens = kv_cache_memory_bytes // bytes_per_token
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Leave (1 - utilization) of the whole device to activations and other processes.
        budget = free - (1.0 - gpu_memory_utilization) * total - reserved_bytes
        tokens = int(max(budget, 0) // bytes_per_token)
    else:
        tokens = DEFAULT_CPU_KV_CACHE_BYTES // bytes_per_token
    blocks_per_context = -(-max_model_len // block_size)
    num_blocks = min(tokens // block_size, max_num_seqs * blocks_per_context)
    if num_blocks < blocks_per_context and tokens >= max_model_len:
        # The budget holds a context's tokens, not its blocks: the block size is the cause.
        raise ValueError(f"the KV cache budget's {tokens} tokens hold {tokens // block_size} blocks of --block-size "
                         f"{block_size}, fewer than the {blocks_per_context} a {max_model_len}-token context needs; "
                         "use a smaller --block-size (16 by default)")
    if num_blocks < blocks_per_context:
        raise ValueError(
            f"the KV cache budget holds {tokens} tokens ({bytes_per_token} bytes each), fewer than one "
            f"{max_model_len}-token context; raise --kv-cache-memory-bytes / --kv-cache-tokens or lower "
            f"--max-model-len")
    return num_blocks


class PagedKVCache:
    """key, value: [num_layers, num_blocks, block_size, num_kv_heads, head_dim].

    Token-major inside a block: a decode's gather by block table (index_select over blocks)
    then views as [B, L, Hkv, D] and attention reads it transposed without a copy, which
    measured fastest on CPU against a head-major [.., Hkv, block_size, D] layout (that one
    needs a reshape copy after the gather).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, padding_block: bool = False) -> None:
        # padding_block: one more block past the num_blocks the block manager hands out, where
        # the padding rows of a CUDA graph's batch write (cuda_graphs.py); nothing reads it.
        shape = (num_layers, num_blocks + (1 if padding_block else 0), block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.padding_slot = num_blocks * block_size if padding_block else None
        # zeros, not empty: masked-out positions of a gathered block are multiplied by zero
        # attention weight, and NaN garbage from uninitialised memory would give 0 * NaN = NaN.
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        # Each layer's [num_blocks, block_size, Hkv, D] views, made once: indexing key[layer]
        # anew is ~2 us a call, four calls a layer, on a one-stream decode step of ~5 ms.
        self.layer_keys = list(self.key.unbind(0))
        self.layer_values = list(self.value.unbind(0))
        # A compiled decode attention that reads this layout in place (model_worker/kernels:
        # bf16 on AVX512-BF16 CPUs), set by the ModelRunner; None: attention gathers with torch ops.
        self.decode_kernel: Callable[..., torch.Tensor] | None = None

    @property
    def num_bytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [T, Hkv, D] go to flat positions slot_mapping [T] (block * block_size + offset)."""
        k = self.layer_keys[layer].view(-1, *key.shape[1:])  # [num_blocks * block_size, Hkv, D]
        v = self.layer_values[layer].view(-1, *value.shape[1:])
        k.index_copy_(0, slot_mapping, key)
        v.index_copy_(0, slot_mapping, value)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: block dst[i] of every layer gets block src[i]'s keys and values."""
        self.key[:, dst] = self.key[:, src]
        self.value[:, dst] = self.value[:, src]
