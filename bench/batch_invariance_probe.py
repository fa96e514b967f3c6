"""Which of the model forward's ops give a row a result that depends on the batch around it.

For each op (SmolLM2-135M's shapes) and dtype, one probe row is computed alone and inside
batches of other sizes at other positions; prints the largest difference from the alone result
(0 = bitwise batch-invariant on this CPU). Used to choose what --batch-invariant changes.
Run: .venv/bin/python bench/batch_invariance_probe.py [--threads N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model_worker.models.linear import Linear
from model_worker.models.llama import rms_norm

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
BATCHES = (2, 3, 8, 16, 17, 32, 64, 130, 700, 2048)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def row_probe(op: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype) -> float:
    """Largest |op(batch)[p] - op(row)| over batch sizes and positions p of the probe row."""
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(1, width, generator=gen).to(dtype)
    alone = op(row)
    worst = 0.0
    for batch in BATCHES:
        for pos in (0, batch // 2, batch - 1):
            x = torch.randn(batch, width, generator=gen).to(dtype)
            x[pos] = row[0]
            worst = max(worst, max_diff(op(x)[pos], alone[0]))
    return worst


def decode_attention_probe(dtype: torch.dtype) -> float:
    """One query over its own L keys alone vs in a batch padded (and masked) to longer contexts."""
    gen = torch.Generator().manual_seed(1)
    length = 37
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen).to(dtype)
    alone = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    worst = 0.0
    for batch, padded in ((2, 48), (8, 160), (32, 1040)):
        qs = torch.randn(batch, HEADS, 1, HEAD_DIM, generator=gen).to(dtype)
        ks = torch.randn(batch, KV_HEADS, padded, HEAD_DIM, generator=gen).to(dtype)
        vs = torch.randn(batch, KV_HEADS, padded, HEAD_DIM, generator=gen).to(dtype)
        qs[0], ks[0, :, :length], vs[0, :, :length] = q[0], k[0], v[0]
        mask = torch.ones(batch, 1, 1, padded, dtype=torch.bool)
        mask[0, :, :, length:] = False
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        worst = max(worst, max_diff(out[0], alone[0]))
    return worst


def prefill_attention_probe(dtype: torch.dtype) -> float:
    """Query at position p: in one causal chunk of the whole prompt vs in a later chunk with a
    cached context (another chunked-prefill split) vs alone as one query over p + 1 keys."""
    gen = torch.Generator().manual_seed(2)
    n, p = 300, 250
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen).to(dtype)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0, :, p]
    alone = F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1], enable_gqa=True)
    worst = max_diff(whole, alone[0, :, 0])
    for start in (64, 200, 240):
        mask = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]
        chunk = F.scaled_dot_product_attention(q[:, :, start:], k, v, attn_mask=mask, enable_gqa=True)
        worst = max(worst, max_diff(chunk[0, :, p - start], whole))
    return worst


def topk_tie_probe(dtype: torch.dtype) -> str:
    """Rows (of 256, V = 49152, logits rounded to dtype) whose top-3 ids differ between topk(3)
    and topk(5)[:3]: torch.topk's order among equal values follows k, the batch's largest
    top_logprobs in the sampler (fixed by sampling.processors.topk_lowest_id_first)."""
    x = torch.randn(256, VOCAB, generator=torch.Generator().manual_seed(4)).to(dtype).float()
    differ = (x.topk(3, dim=-1).indices != x.topk(5, dim=-1).indices[:, :3]).any(dim=-1)
    return f"{int(differ.sum())}/256 rows"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| op | float32 | bfloat16 |\n|---|---:|---:|")
    gen = torch.Generator().manual_seed(3)
    weights = {name: torch.randn(n, k, generator=gen) * 0.02 for name, n, k in (
        ("qkv", HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), ("gate_up", 2 * INTER, HIDDEN),
        ("down", HIDDEN, INTER), ("lm_head", VOCAB, HIDDEN))}
    norm_weight = torch.ones(HIDDEN)
    for row_tile in (0, 16):
        for name, weight in weights.items():
            cells = []
            for dtype in (torch.float32, torch.bfloat16):
                linear = Linear(weight.to(dtype), row_tile=row_tile)
                cells.append(f"{row_probe(linear, weight.shape[1], dtype):.3g}")
            label = f"Linear {name} [{weight.shape[0]}x{weight.shape[1]}]" + (f", row tiles of {row_tile}"
                                                                                if row_tile else "")
            print(f"| {label} | " + " | ".join(cells) + " |")
    for label, op, width in (
        ("rms_norm", lambda x: rms_norm(x, norm_weight.to(x.dtype), 1e-5), HIDDEN),
        ("silu(gate) * up", lambda x: F.silu(x[:, :INTER]) * x[:, INTER:], 2 * INTER),
        ("log_softmax (sampler)", lambda x: torch.log_softmax(x.float(), dim=-1), VOCAB),
    ):
        cells = [f"{row_probe(op, width, dtype):.3g}" for dtype in (torch.float32, torch.bfloat16)]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for label, probe in (("decode SDPA, padded + masked batch", decode_attention_probe),
                         ("prefill SDPA, query's chunk split", prefill_attention_probe)):
        print(f"| {label} | " + " | ".join(f"{probe(d):.3g}" for d in (torch.float32, torch.bfloat16)) + " |")
    print("| topk ids, k = 3 vs 5 (logprobs) | " + " | ".join(topk_tie_probe(d) for d in (torch.float32, torch.bfloat16))
          + " |")


if __name__ == "__main__":
    main()
