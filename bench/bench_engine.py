"""Greedy decode throughput: tokenwire's LLMEngine against transformers' generate(), side by side.

Sits beside the model worker, not in it: drives ModelRunner + LLMEngine directly (no gRPC) and
HF generate() on the same converted SmolLM2 directory, the same prompts, in one process.

    .venv/bin/python bench/bench_engine.py --batch-sizes 1,8,32 --output-tokens 64 --json bench/results/engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Run as a script (`python bench/bench_engine.py`), sys.path[0] is bench/; the packages sit
# one level up and need not be pip-installed.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from model_worker.engine import LLMEngine  # noqa: E402
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from model_worker.model_runner import ModelRunner  # noqa: E402
from model_worker.sequence import SamplingParams  # noqa: E402

DTYPE = torch.float32
DEVICE = torch.device("cpu")


@dataclass
class BatchResult:
    batch: int
    generated_tokens: int  # batch * output_tokens, for each side
    tokenwire_s: float
    transformers_s: float
    tokenwire_tok_s: float
    transformers_tok_s: float
    ratio: float  # tokenwire_tok_s / transformers_tok_s
    # Mean length of the common prefix of the two sides' outputs, over output_tokens: a check that
    # both ran the same greedy decode (float32 batching differences may split them late).
    agreement: float


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """prompt_ids: [B, L]. Equal lengths, so neither side pads and both do exactly the same work."""
    generator = torch.Generator().manual_seed(seed)
    # Skip the first ids: SmolLM2 keeps its special tokens there.
    return torch.randint(100, vocab_size, (batch, prompt_len), generator=generator)


def run_tokenwire(runner: ModelRunner, prompts: torch.Tensor, output_tokens: int) -> tuple[float, list[list[int]]]:
    """All requests are added up front, then step() runs until the engine is empty (prefill included)."""
    batch = prompts.shape[0]
    # A fresh engine per batch size: max_num_seqs caps the running batch at exactly `batch`.
    engine = LLMEngine(runner, eos_token_ids=[], max_num_seqs=batch, max_num_batched_tokens=2048,
                       max_waiting_requests=10_000)
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in range(batch)}
    start = time.perf_counter()
    for seq_id, prompt in enumerate(prompts.tolist()):
        engine.add_request(seq_id, prompt, SamplingParams(), max_tokens=output_tokens, stop_token_ids=[],
                           ignore_eos=True)
    while engine.has_work():
        for out in engine.step():
            if out.token_id is not None:
                outputs[out.seq_id].append(out.token_id)
    elapsed = time.perf_counter() - start
    return elapsed, [outputs[seq_id] for seq_id in range(batch)]


def run_transformers(model, prompts: torch.Tensor, output_tokens: int, pad_token_id: int) -> tuple[float, list[list[int]]]:
    """One static batch; min_new_tokens = max_new_tokens so EOS cannot end a row early."""
    attention_mask = torch.ones_like(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        generated = model.generate(input_ids=prompts, attention_mask=attention_mask, do_sample=False,
                                   max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                                   pad_token_id=pad_token_id)
    elapsed = time.perf_counter() - start
    new_tokens = generated[:, prompts.shape[1]:]  # [B, output_tokens]
    assert new_tokens.shape[1] == output_tokens, new_tokens.shape
    return elapsed, new_tokens.tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tokenwire"),
                        help="where the converted default model is cached")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers import __version__ as transformers_version
    from transformers.utils import logging as hf_logging

    # generate() warns about unused sampling fields of the generation config on every call.
    hf_logging.set_verbosity_error()

    model_dir = resolve_model_dir(DEFAULT_MODEL, Path(args.cache_dir))
    max_model_len = args.prompt_len + args.output_tokens
    runner = ModelRunner(model_dir, "auto", DEVICE, DTYPE, max_num_seqs=max(batch_sizes),
                         max_model_len=max_model_len)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE).eval()
    pad_token_id = hf_model.generation_config.pad_token_id or 0

    # Warm both paths once (allocator, kernel selection) so batch 1 is not charged for it.
    warm = make_prompts(2, args.prompt_len, runner.vocab_size, seed=1)
    run_tokenwire(runner, warm, 4)
    run_transformers(hf_model, warm, 4, pad_token_id)

    print(f"SmolLM2-135M-Instruct float32 on CPU, torch threads={torch.get_num_threads()}, "
          f"prompt {args.prompt_len} tokens, {args.output_tokens} output tokens per sequence", flush=True)
    header = f"{'batch':>5}  {'tokenwire tok/s':>15}  {'transformers tok/s':>18}  {'ratio':>6}  {'agree':>5}"
    print(header)
    print("-" * len(header), flush=True)
    results: list[BatchResult] = []
    for batch in batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, runner.vocab_size)
        tw_s, tw_out = run_tokenwire(runner, prompts, args.output_tokens)
        hf_s, hf_out = run_transformers(hf_model, prompts, args.output_tokens, pad_token_id)
        assert all(len(o) == args.output_tokens for o in tw_out), "tokenwire stopped a sequence early"
        generated = batch * args.output_tokens
        agreement = sum(common_prefix(a, b) for a, b in zip(tw_out, hf_out, strict=True)) / generated
        result = BatchResult(batch, generated, tw_s, hf_s, generated / tw_s, generated / hf_s,
                             hf_s / tw_s, agreement)
        results.append(result)
        print(f"{batch:>5}  {result.tokenwire_tok_s:>15.1f}  {result.transformers_tok_s:>18.1f}  "
              f"{result.ratio:>5.2f}x  {agreement:>5.2f}", flush=True)

    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "model": "SmolLM2-135M-Instruct", "model_dir": str(model_dir), "dtype": "float32", "device": "cpu",
            "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
            "output_tokens": args.output_tokens, "torch": torch.__version__,
            "transformers": transformers_version, "python": platform.python_version(),
            "machine": platform.machine(), "results": [asdict(r) for r in results],
        }, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
