"""The sampler step alone: greedy fast path vs plain sampling vs the full chain, per batch size,
vocabulary size and device, side by side in one process; on CPU also the greedy and sampled
paths on the model worker's C++ picks (model_worker/kernels/sampling_ops.cpp) where they build.

Sits beside the model worker: drives model_worker.sampling.Sampler on random logits with
Sequences whose token lists grow each step, as the engine's would (so the batch view is reused
and the penalty counts are updated in place, not rebuilt).

    .venv/bin/python bench/bench_sampler.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from model_worker.kernels import sampling_ops_module  # noqa: E402
from model_worker.sampling import Sampler  # noqa: E402
from model_worker.sampling.batch import SamplingBatch  # noqa: E402
from model_worker.sequence import SamplingParams, Sequence  # noqa: E402

MODES = {
    "greedy": SamplingParams(),
    "sample": SamplingParams(temperature=1.0, seed=1),
    # top_p alone, as OpenAI clients send it; on these random logits its cut lies thousands of
    # tokens deep, so it settles in the histogram band (processors.top_p_removed), not the top-64.
    "top_p": SamplingParams(temperature=1.0, top_p=0.95, seed=1),
    # Every stage of the default chain at once, with logprobs.
    "full": SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, typical_p=0.95, top_n_sigma=2.0,
        xtc_threshold=0.1, xtc_probability=0.5, dry_multiplier=0.8, presence_penalty=0.5,
        frequency_penalty=0.5, repetition_penalty=1.1, repeat_penalty=1.1, logit_bias=((10, 1.0), (11, -1.0)),
        min_tokens=4, bad_words=((5, 6),), seed=1, logprobs=True, top_logprobs=5),
}


def make_sequences(params: SamplingParams, batch: int, vocab: int, prompt_len: int, history: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(0, vocab, (prompt_len + history,), generator=gen).tolist()
        seqs.append(Sequence(seq_id=i, prompt_token_ids=tokens[:prompt_len], sampling=params, max_tokens=10**6,
                             stop_token_ids=frozenset({2}), output_token_ids=tokens[prompt_len:]))
    return seqs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_mode(params: SamplingParams, batch: int, vocab: int, device: torch.device, min_seconds: float,
              min_steps: int, argmax=None, gumbel_argmax=None, top_p_rows=None) -> tuple[float, float]:
    """-> (ms per step, ms to build the batch view from scratch: what a step pays when the batch's
    rows change, counts from token lists included)."""
    seqs = make_sequences(params, batch, vocab, prompt_len=64, history=32)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(1)).to(device)  # [B, V]
    sampler = Sampler(vocab, device, argmax, gumbel_argmax, top_p_rows)

    def step() -> None:
        token_ids = sampler.sample(logits, seqs).token_ids.tolist()  # the engine's one host copy
        for seq, token in zip(seqs, token_ids, strict=True):
            seq.output_token_ids.append(token)

    sync(device)
    start = time.perf_counter()
    SamplingBatch.build(seqs, vocab, device, None, {})
    sync(device)
    build_ms = (time.perf_counter() - start) * 1e3
    step()  # builds the sampler's own batch view
    step()  # warm-up of the incremental path
    steps = 0
    sync(device)
    start = time.perf_counter()
    while steps < min_steps or time.perf_counter() - start < min_seconds:
        step()
        steps += 1
    sync(device)
    return (time.perf_counter() - start) * 1e3 / steps, build_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32,256")
    parser.add_argument("--vocab-sizes", default="49152,151936")
    parser.add_argument("--devices", default="cpu,cuda", help="cuda is skipped when torch sees none")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="time each case at least this long")
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    rows = []
    kernel = sampling_ops_module()
    header = ("| device | vocab | batch | greedy ms | greedy, C++ argmax ms | sample ms | sample, C++ draw ms | "
              "top_p ms | top_p, C++ ms | full ms | full / greedy | "
              "full / sample | full build ms |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for device in devices:
        for vocab in (int(v) for v in args.vocab_sizes.split(",")):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                ms = {}
                build = {}
                for name, params in MODES.items():
                    ms[name], build[name] = time_mode(params, batch, vocab, device, args.min_seconds, args.min_steps)
                if device.type == "cpu" and kernel is not None:
                    ms["greedy_kernel"], _ = time_mode(MODES["greedy"], batch, vocab, device, args.min_seconds,
                                                       args.min_steps, kernel.argmax_rows)
                    ms["sample_kernel"], _ = time_mode(MODES["sample"], batch, vocab, device, args.min_seconds,
                                                       args.min_steps, kernel.argmax_rows, kernel.gumbel_argmax_rows)
                    ms["top_p_kernel"], _ = time_mode(MODES["top_p"], batch, vocab, device, args.min_seconds,
                                                      args.min_steps, kernel.argmax_rows, kernel.gumbel_argmax_rows,
                                                      kernel.top_p_rows)
                row = {"device": device.type, "vocab": vocab, "batch": batch, **{f"{k}_ms": v for k, v in ms.items()},
                       "full_build_ms": build["full"], "full_over_greedy": ms["full"] / ms["greedy"],
                       "full_over_sample": ms["full"] / ms["sample"]}
                rows.append(row)
                greedy_kernel = f"{ms['greedy_kernel']:.3f}" if "greedy_kernel" in ms else "-"
                sample_kernel = f"{ms['sample_kernel']:.3f}" if "sample_kernel" in ms else "-"
                top_p_kernel = f"{ms['top_p_kernel']:.3f}" if "top_p_kernel" in ms else "-"
                print(f"| {device.type} | {vocab} | {batch} | {ms['greedy']:.3f} | {greedy_kernel} | "
                      f"{ms['sample']:.3f} | {sample_kernel} | {ms['top_p']:.3f} | {top_p_kernel} | {ms['full']:.3f} | {row['full_over_greedy']:.1f}x | {row['full_over_sample']:.1f}x | "
                      f"{build['full']:.1f} |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
