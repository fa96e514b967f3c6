"""What pre-packed oneDNN weights buy: SmolLM2 engine decode step times with the bf16 linear
layers on their packed weights vs on F.linear, side by side in one process.

One engine (the model worker's own build, from its flags) runs `--batch-size` greedy requests;
after a warm-up its decode steps alternate between packed and plain weights, so both modes see
the same machine load and nearly the same context lengths. Prints median and best step times
and the ratio; the outputs are bitwise the same either way (tests/test_linear_packed.py).

    .venv/bin/python bench/bench_packed_linear.py --batch-sizes 1,32 -- --num-threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.workload import engine_bench_args  # noqa: E402
from model_worker.__main__ import build_engine  # noqa: E402
from model_worker.config import Config  # noqa: E402
from model_worker.models.linear import Linear  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402
from tokenwire.config_cli import parse_config  # noqa: E402


def linear_layers(model) -> list[Linear]:
    """Every Linear of a native Llama-family model (its per-layer dicts and lm_head)."""
    return [v for layer in model.layers for v in layer.values() if isinstance(v, Linear)] + [model.lm_head]


def bench_batch(engine, batch: int, steps: int, base_id: int) -> dict[str, list[float]]:
    layers = linear_layers(engine.runner.model)
    packed = [layer.packed_weight for layer in layers]
    if not any(w is not None for w in packed):
        raise SystemExit("no packed weights: needs --dtype bfloat16 on a CPU with oneDNN")
    for layer, weight in zip(layers, packed, strict=True):
        if weight is not None and layer.weight is None:  # the plain copy F.linear needs, for the comparison
            layer.weight = weight.to_dense()
    for i in range(batch):
        engine.add_request(base_id + i, list(range(100, 132)), SamplingParams(), steps + 8, [], True)
    for _ in range(4):  # prefill and the first decodes, untimed
        engine.step()
    times: dict[str, list[float]] = {"packed": [], "plain": []}
    for step in range(steps):
        mode = "packed" if step % 2 == 0 else "plain"
        for layer, weight in zip(layers, packed, strict=True):
            layer.packed_weight = weight if mode == "packed" else None
        start = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - start)
    for layer, weight in zip(layers, packed, strict=True):
        layer.packed_weight = weight
    while engine.has_work():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> None:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=60, help="timed decode steps per batch size (half each mode)")

    args, worker_args = engine_bench_args(__doc__, argv, add_args)
    batches = args.batch_sizes
    config = parse_config(Config, argv=["--max-num-seqs", str(max(batches)), "--max-model-len",
                                        str(32 + args.steps + 16), "--dtype", "bfloat16", *worker_args])
    engine, _, _, _ = build_engine(config)
    print("| batch | packed step ms (median / best) | F.linear step ms (median / best) | plain / packed |")
    print("|---|---|---|---|")
    for n, batch in enumerate(batches):
        times = bench_batch(engine, batch, args.steps, base_id=n * 10_000)
        med = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
        best = {mode: min(t) * 1e3 for mode, t in times.items()}
        print(f"| {batch} | {med['packed']:.1f} / {best['packed']:.1f} | {med['plain']:.1f} / {best['plain']:.1f} "
              f"| {med['plain'] / med['packed']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
