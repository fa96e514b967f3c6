"""What --batch-invariant costs: engine step time with the flag over without, side by side in one
process (SmolLM2-135M, or the tiny random model), at several batch sizes.

Two ModelRunners (same weights, one with batch_invariant=True) each drive an LLMEngine with the
same greedy requests; their prefill steps and then their decode steps alternate, so both see the
same machine load. Prints median step times and the ratio.

    .venv/bin/python bench/bench_batch_invariant.py --threads 1 --batch-sizes 1,32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from model_worker.engine import LLMEngine  # noqa: E402
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from model_worker.model_runner import ModelRunner  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402

CPU = torch.device("cpu")


def tiny_model_dir(smollm2_dir: Path, out: Path) -> Path:
    """The test suite's tiny 2-layer config (tests/conftest.py) with random weights."""
    config = json.loads((smollm2_dir / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def new_engine(runner: ModelRunner, batch: int, prompts: list[list[int]], max_tokens: int) -> LLMEngine:
    engine = LLMEngine(runner, [], max_num_seqs=batch, max_num_batched_tokens=4096, max_waiting_requests=batch)
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, SamplingParams(), max_tokens, [], True)
    return engine


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def bench_batch(runners: dict[str, ModelRunner], batch: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(batch)
    prefill: dict[str, list[float]] = {name: [] for name in runners}
    decode: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        prompts = torch.randint(100, 40000, (batch, args.prompt_len), generator=gen).tolist()
        engines = {name: new_engine(r, batch, prompts, args.decode_steps + 1) for name, r in runners.items()}
        for name, engine in engines.items():  # one step prefills every prompt (batch * prompt_len tokens)
            prefill[name].append(timed_step(engine))
        for _ in range(args.decode_steps):
            for name, engine in engines.items():
                decode[name].append(timed_step(engine))
    row = {"batch": batch}
    for phase, times in (("prefill", prefill), ("decode", decode)):
        default, invariant = (statistics.median(times[name]) for name in ("default", "batch_invariant"))
        row |= {f"{phase}_default_ms": default * 1e3, f"{phase}_invariant_ms": invariant * 1e3,
                f"{phase}_ratio": invariant / default}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random model instead of SmolLM2")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default="")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(DEFAULT_MODEL, Path.home() / ".cache" / "tokenwire")
    load_format = "auto"
    if args.tiny:
        model_dir, load_format = tiny_model_dir(model_dir, Path("/tmp/tokenwire-bench-tiny")), "dummy"
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    max_len = args.prompt_len + args.decode_steps + 8
    runners = {name: ModelRunner(model_dir, load_format, CPU, dtype, max(batches), max_len,
                                 batch_invariant=name == "batch_invariant")
               for name in ("default", "batch_invariant")}
    print(f"{model_dir.name} {args.dtype}, {torch.get_num_threads()} threads, prompts of {args.prompt_len} tokens")
    print("| batch | prefill default ms | prefill invariant ms | ratio | decode default ms | decode invariant ms "
          "| ratio |\n|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for batch in batches:
        row = bench_batch(runners, batch, args)
        rows.append(row)
        print(f"| {batch} | {row['prefill_default_ms']:.1f} | {row['prefill_invariant_ms']:.1f} | "
              f"{row['prefill_ratio']:.2f} | {row['decode_default_ms']:.1f} | {row['decode_invariant_ms']:.1f} | "
              f"{row['decode_ratio']:.2f} |", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": model_dir.name, "dtype": args.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
