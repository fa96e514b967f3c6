"""What pre-packed oneDNN weights buy: SmolLM2 engine decode step times with the bf16 linear
layers on their packed weights vs on F.linear, side by side in one process.

One engine (the model worker's own build, from its flags) runs `--batch-size` greedy requests;
after a warm-up its decode steps alternate between packed and plain weights, so both modes see
the same machine load and nearly the same context lengths. Prints median and best step times
and the ratio; the outputs are bitwise the same either way (tests/test_linear_packed.py).

    .venv/bin/python bench/bench_packed_linear.py --batch-sizes 1,32 -- --num-threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.step_bench import run_step_bench  # noqa: E402
from bench.workload import alternate_decode_steps  # noqa: E402
from model_worker.model_runner import native_linear_layers as linear_layers  # noqa: E402 (other benches use it)
from model_worker.sequence import SamplingParams  # noqa: E402


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

    def set_mode(mode: str) -> None:
        for layer, weight in zip(layers, packed, strict=True):
            layer.packed_weight = weight if mode == "packed" else None

    return alternate_decode_steps(engine, steps, ("packed", "plain"), set_mode)


def main(argv: list[str] | None = None) -> None:
    run_step_bench(__doc__, argv, "| batch | packed step ms (median / best) | F.linear step ms (median / best) | plain / packed |",
                   bench_batch, ["--cpu-bf16-matmul", "onednn"])


if __name__ == "__main__":
    main()
