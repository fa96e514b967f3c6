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


class DecodeModel(Protocol):
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself): padding
    costs at most 7 rows past 8, as in vLLM's default capture sizes."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


def capture_widths(max_blocks: int) -> list[int]:
    """Powers of two from MIN_WIDTH_BLOCKS blocks, and max_blocks (a full context) last."""
    widths = []
    width = MIN_WIDTH_BLOCKS
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


def smallest_at_least(sizes: Sequence[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


class DecodeGraphRunner:
    """Runs decode steps of up to max(batch_sizes) sequences through captured graphs (CUDA) or
    the same padded static-shape forward (elsewhere)."""

    def __init__(self, model: DecodeModel, kv: PagedKVCache, max_num_seqs: int, max_model_len: int,
                 device: torch.device, sliding_window: int = 0, capture: bool | None = None) -> None:
        if kv.padding_slot is None:
            raise ValueError("decode graphs need a KV cache with a padding block (PagedKVCache(padding_block=True))")
        self.model = model
        self.kv = kv
        self.device = device
        self.sliding_window = sliding_window
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
        # (batch size, width) -> (graph, its static logits [B, V]); filled by capture_all().
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, num_seqs: int, max_context_len: int) -> bool:
        """Whether a decode step of num_seqs sequences, the longest with max_context_len cached
        positions before its new token, has a bucket."""
        num_blocks = max_context_len // self.kv.block_size + 1
        return num_seqs <= self._max_batch and num_blocks <= self.widths[-1]

    def bucket(self, num_seqs: int, max_context_len: int) -> tuple[int, int]:
        batch = smallest_at_least(self.batch_sizes, num_seqs)
        width = smallest_at_least(self.widths, max_context_len // self.kv.block_size + 1)
        if batch is None or width is None:
            raise ValueError(f"no decode bucket for {num_seqs} sequences of up to {max_context_len} positions")
        return batch, width

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
        seq_lens = self._static[3 * m:3 * m + batch]
        key_positions = self._key_positions[:width * bs]
        mask = key_positions[None, :] < seq_lens[:, None]  # [B, W * bs]
        window_mask = None
        if self.sliding_window:
            window_mask = (mask & (key_positions[None, :] >= seq_lens[:, None] - self.sliding_window))[:, None, None, :]
        decode = DecodeBatch(start=0, block_tables=self._static[self._tables_at:self._tables_at + batch * width]
                             .view(batch, width), mask=mask[:, None, None, :], seq_lens=seq_lens,
                             window_mask=window_mask)
        meta = AttentionMetadata(positions=self._static[m:m + batch], slot_mapping=self._static[2 * m:2 * m + batch],
                                 prefills=[], decode=decode, sliding_window=self.sliding_window)
        hidden = self.model.forward(self._static[:batch], meta, self.kv)
        return self.model.logits(hidden)

    # ---- capture and replay ----

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every bucket, largest first so the shared memory pool is sized by the largest
        and the smaller ones reuse it. Buffers hold padding only, so capture writes no real KV."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for width in reversed(self.widths):
            for batch in reversed(self.batch_sizes):
                self._fill([], [], batch, width)
                # Warm up off the capture: lazy initialisation (cuBLAS workspaces, autotuning) must
                # not happen inside the graph.
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._forward(batch, width)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(batch, width)
                self._graphs[(batch, width)] = (graph, logits)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, decodes: Sequence[tuple[Sequence[int], int]], input_ids: Sequence[int]) -> torch.Tensor:
        """decodes: (block table, cached positions before the new token) per sequence; input_ids:
        each one's new token -> logits [len(decodes), V]. The rows are a view of the graph's
        output, valid until the next run."""
        batch, width = self.bucket(len(decodes), max(context_len for _, context_len in decodes))
        self._fill(decodes, input_ids, batch, width)
        captured = self._graphs.get((batch, width))
        if captured is None:
            logits = self._forward(batch, width)
        else:
            graph, logits = captured
            graph.replay()
        return logits[:len(decodes)]

    @torch.inference_mode()
    def replay_matches_eager(self, seed: int = 0, atol: float = 0.05) -> float:
        """Max |logit difference| between a replay and an eager forward of the largest bucket on the
        same random inputs (keys and values go to the padding block only); raises when it is over
        atol, so a graph that does not reproduce the model is never used."""
        if not self._graphs:
            return 0.0
        batch, width = self.batch_sizes[-1], self.widths[-1]
        gen = torch.Generator().manual_seed(seed)
        vocab = self._graphs[(batch, width)][1].shape[-1]
        self._fill([], [], batch, width)  # every row padding: keys and values go to the padding block
        m = self._max_batch
        self._static[:batch] = torch.randint(0, vocab, (batch,), generator=gen)
        # Real lengths, so attention reads real (if meaningless) blocks, not one position.
        self._static[3 * m:3 * m + batch] = torch.randint(1, width * self.kv.block_size + 1, (batch,), generator=gen)
        graph, replayed = self._graphs[(batch, width)]
        graph.replay()
        replayed = replayed.clone()
        eager = self._forward(batch, width)
        error = float((replayed - eager).abs().max())
        if not error <= atol:
            raise RuntimeError(f"CUDA graph replay differs from the eager forward by {error} (> {atol})")
        return error
