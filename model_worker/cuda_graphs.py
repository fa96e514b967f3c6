"""CUDA graphs of the decode step: one captured forward per (batch size, context width) bucket.

A decode step of a small batch on a GPU is mostly kernel launches (about twenty per layer, each a
few microseconds of host time); replaying a captured graph issues them all at once. A graph fixes
every shape and every buffer address, so each bucket's forward reads its inputs from static
device buffers that `run` fills (one host-to-device copy) before the replay:

- b sequences run in the smallest captured batch size >= b. The rows past b are padding: they
  write their keys and values to the cache's padding block (never in a block table), attend to
  one position, and their logits are dropped.
- Attention gathers the smallest captured width (in blocks) >= the longest context, so a graph
  for short contexts does not read as many blocks as a full max_model_len context needs.

Prefill steps, and decode steps beyond the largest bucket, run eagerly (ModelRunner decides).
On a CPU there is nothing to capture: the same padded static-buffer forward runs eagerly, which
is how the tests check the buffers and padding without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from model_worker.attention_metadata import AttentionMetadata, DecodeBatch
from model_worker.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

# Context widths below this many blocks share one graph: attention over a few extra masked
# blocks costs less than more graphs (capture time, memory).
MIN_WIDTH_BLOCKS = 4


# Larger decode batches run eagerly: their launch overhead is small next to their work, and each
# graph's buffers grow with the batch.
MAX_CAPTURE_BATCH = 256


class Replayable(Protocol):
    def replay(self) -> None: ...


class DecodeModel(Protocol):
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself), at most
    MAX_CAPTURE_BATCH: padding costs at most 7 rows past 8, as in vLLM's default capture sizes."""
    top = min(max_num_seqs, MAX_CAPTURE_BATCH)
    sizes = [b for b in (1, 2, 4) if b < top] + list(range(8, top, 8))
    return sorted({*sizes, top})


def capture_widths(max_blocks: int) -> list[int]:
    """Powers of two from MIN_WIDTH_BLOCKS blocks, and max_blocks (a full context) last."""
    widths = []
    width = MIN_WIDTH_BLOCKS
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


class DecodeGraphRunner:
    """Runs decode steps through captured graphs (CUDA) or the same padded static-shape forward
    (elsewhere), for batches of up to MAX_CAPTURE_BATCH sequences."""

    def __init__(self, model: DecodeModel, kv: PagedKVCache, max_num_seqs: int, max_model_len: int,
                 vocab_size: int, device: torch.device, sliding_window: int = 0,
                 capture: bool | None = None) -> None:
        if kv.padding_slot is None:
            raise ValueError("decode graphs need a KV cache with a padding block (PagedKVCache(padding_block=True))")
        self.model = model
        self.kv = kv
        self.device = device
        self.sliding_window = sliding_window
        self.max_model_len = max_model_len
        self.capture = device.type == "cuda" if capture is None else capture
        block_size = kv.block_size
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.widths = capture_widths(-(-max_model_len // block_size))
        max_batch, max_width = self.batch_sizes[-1], self.widths[-1]
        self._max_batch = max_batch
        # One int64 buffer, laid out [ids | positions | slots | seq_lens | block tables]: a step
        # fills the host copy and moves it with one copy. The block tables of a (B, W) bucket are
        # its first B * W entries, contiguous [B, W], as the attention's gather wants them.
        self._tables_at = 4 * max_batch
        size = self._tables_at + max_batch * max_width
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host_view = self._host.numpy()
        self._static = torch.zeros(size, dtype=torch.long, device=device)
        self._key_positions = torch.arange(max_width * block_size, device=device)
        self._copied: torch.cuda.Event | None = None
        # Every graph ends by copying its logits here: one buffer for all of them, where each
        # keeping its own [B, V] float32 output alive would hold sum(B) x widths rows of memory.
        self._logits = torch.zeros(max_batch, vocab_size, dtype=torch.float32, device=device)
        # (batch size, width) -> graph; filled by capture_all(). Without capture every bucket runs.
        self._graphs: dict[tuple[int, int], Replayable] = {}

    def _has_bucket(self, batch: int, width: int) -> bool:
        return not self.capture or (batch, width) in self._graphs

    def bucket(self, num_seqs: int, max_context_len: int) -> tuple[int, int] | None:
        """The smallest (batch size, width) bucket, captured where capture is on, that holds
        num_seqs sequences whose longest has max_context_len cached positions before its new
        token; None when none does (the step runs eagerly)."""
        num_blocks = max_context_len // self.kv.block_size + 1
        for width in self.widths:
            if width < num_blocks:
                continue
            for batch in self.batch_sizes:
                if batch >= num_seqs and self._has_bucket(batch, width):
                    return batch, width
        return None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ---- filling the static buffers ----

    def _fill(self, decodes: Sequence[tuple[Sequence[int], int]], input_ids: Sequence[int], batch: int,
              width: int) -> None:
        """Host buffer <- the step's inputs (padding rows past len(decodes)), then one copy to the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        h = self._host_view
        n, m, bs = len(decodes), self._max_batch, self.kv.block_size
        ids, positions, slots, seq_lens = h[0:m], h[m:2 * m], h[2 * m:3 * m], h[3 * m:4 * m]
        tables = h[self._tables_at:self._tables_at + batch * width].reshape(batch, width)
        tables[:] = 0
        for row, (table, context_len) in enumerate(decodes):
            used = context_len // bs + 1
            tables[row, :used] = table[:used]
            positions[row] = context_len
            slots[row] = table[context_len // bs] * bs + context_len % bs
            seq_lens[row] = context_len + 1
        ids[:n] = input_ids
        ids[n:batch] = 0
        positions[n:batch] = 0
        slots[n:batch] = self.kv.padding_slot
        seq_lens[n:batch] = 1
        used_size = self._tables_at + batch * width
        self._static[:used_size].copy_(self._host[:used_size], non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        """The bucket's forward on the static buffers -> logits [batch, V] (what a graph captures)."""
        m, bs = self._max_batch, self.kv.block_size
        # The masks are computed inside the graph, from the lengths in the static buffer.
        decode = DecodeBatch.masked(0, self._static[self._tables_at:self._tables_at + batch * width].view(batch, width),
                                    self._static[3 * m:3 * m + batch], self._key_positions[:width * bs],
                                    self.sliding_window)
        meta = AttentionMetadata(positions=self._static[m:m + batch], slot_mapping=self._static[2 * m:2 * m + batch],
                                 prefills=[], decode=decode, sliding_window=self.sliding_window)
        hidden = self.model.forward(self._static[:batch], meta, self.kv)
        return self.model.logits(hidden)

    # ---- capture and replay ----

    @torch.inference_mode()
    def warm_up_largest(self) -> None:
        """The largest bucket's forward once, on padding: what its capture will need in memory."""
        batch, width = self.batch_sizes[-1], self.widths[-1]
        self._fill([], [], batch, width)
        self._forward(batch, width)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every bucket into one shared memory pool, largest first so the smaller ones
        reuse its memory. Buffers hold padding only, so nothing writes real KV.

        First every bucket's forward runs once eagerly on a side stream: lazy initialisation
        (cuBLAS workspaces, kernel choice) must not happen inside a graph. Each warm-up frees its
        memory before the next, so they never need more than the largest bucket's peak, which
        ModelRunner kept out of the KV cache; the pool then holds that peak once. A bucket whose
        warm-up runs out of memory is left out (its steps run eagerly). A failure inside a
        capture raises (ModelRunner then runs every step eagerly)."""
        if not self.capture:
            return
        buckets = [(batch, width) for width in reversed(self.widths) for batch in reversed(self.batch_sizes)]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fitting = [bucket for bucket in buckets if self._warms_up(*bucket)]
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' memory back to the device, for the graphs' pool
        pool = torch.cuda.graph_pool_handle()
        for batch, width in fitting:
            self._fill([], [], batch, width)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[:batch].copy_(self._forward(batch, width))
            self._graphs[(batch, width)] = graph
        torch.cuda.synchronize(self.device)

    def _warms_up(self, batch: int, width: int) -> bool:
        self._fill([], [], batch, width)
        try:
            self._forward(batch, width)
        except torch.cuda.OutOfMemoryError:
            logger.warning("decode bucket of %d sequences x %d blocks does not fit in memory; such steps run "
                           "eagerly", batch, width)
            return False
        return True

    @torch.inference_mode()
    def run(self, decodes: Sequence[tuple[Sequence[int], int]], input_ids: Sequence[int]) -> torch.Tensor | None:
        """decodes: (block table, cached positions before the new token) per sequence; input_ids:
        each one's new token -> logits [len(decodes), V], a view valid until the next run; None
        when no bucket holds the step (the caller runs it eagerly)."""
        bucket = self.bucket(len(decodes), max(context_len for _, context_len in decodes))
        if bucket is None:
            return None
        self._fill(decodes, input_ids, *bucket)
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward(*bucket)[:len(decodes)]
        graph.replay()
        return self._logits[:len(decodes)]

    @torch.inference_mode()
    def check_replays(self, seeds: Sequence[int] = (0, 1), rtol: float = 0.02) -> float:
        """Replays the smallest captured bucket, the widest and the largest batch on random inputs
        and compares each with the eager forward on the same inputs: the worst |logit difference| relative to the
        largest |logit|. Raises when it is over rtol, so a graph that does not follow its inputs
        (a mask, block table, position or slot frozen at capture) is never used.

        Runs at startup, when no sequence owns any block: every row gets its own last block
        (distinct slots, so replay and eager write the same keys and values), random earlier
        blocks and a random length, over a cache of random keys and values; the cache is zeroed
        again afterwards, as PagedKVCache made it."""
        if not self._graphs:
            return 0.0
        # The extremes of batch size and of width, each with the smallest of the other: the
        # eager forward runs outside the graphs' memory pool, so the largest bucket would need
        # its peak twice.
        captured = sorted(self._graphs)
        smallest = captured[0]
        widest = max((b for b in captured if b[0] == smallest[0]), key=lambda b: b[1])
        largest_batch = max((b for b in captured if b[1] == smallest[1]), key=lambda b: b[0])
        worst = 0.0
        try:
            for batch, width in dict.fromkeys((smallest, largest_batch, widest)):
                for seed in seeds:
                    decodes, input_ids = self._random_step(batch, width, seed)
                    self._fill(decodes, input_ids, batch, width)
                    self._graphs[(batch, width)].replay()
                    replayed = self._logits[:len(decodes)].clone()
                    eager = self._forward(batch, width)[:len(decodes)]
                    error = float((replayed - eager).abs().max() / eager.abs().max().clamp(min=1e-6))
                    if not error <= rtol:
                        raise RuntimeError(f"the CUDA graph of {batch} sequences x {width} blocks differs from the "
                                           f"eager forward by {error:.3g} of the largest logit (> {rtol})")
                    worst = max(worst, error)
        finally:
            self.kv.key.zero_()
            self.kv.value.zero_()
        return worst

    def _random_step(self, batch: int, width: int, seed: int) -> tuple[list[tuple[list[int], int]], list[int]]:
        """Decodes of up to `batch` rows (one per usable block but block 0, which padding rows read)
        of random lengths within `width` blocks, their tables random blocks ending in a block of
        their own; the cache filled with random keys and values."""
        gen = torch.Generator().manual_seed(seed)
        on_device = torch.Generator(self.device).manual_seed(seed)  # the cache can be most of the GPU
        kv, bs = self.kv, self.kv.block_size
        kv.key.normal_(generator=on_device)
        kv.value.normal_(generator=on_device)
        rows = min(batch, kv.num_blocks - 1)
        decodes = []
        for row in range(rows):
            # Within the bucket and the model's positions (max_model_len need not fill its last block).
            context_len = int(torch.randint(0, min(width * bs, self.max_model_len), (1,), generator=gen))
            used = context_len // bs + 1
            table = torch.randint(0, kv.num_blocks, (used,), generator=gen).tolist()
            table[-1] = 1 + row
            decodes.append((table, context_len))
        vocab = self._logits.shape[-1]
        return decodes, torch.randint(0, vocab, (rows,), generator=gen).tolist()
