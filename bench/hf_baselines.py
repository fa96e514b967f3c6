"""transformers baselines under the same workload: `generate` static batches and `generate_batch`
continuous batching, greedy, ignoring EOS, timed per token so they report loadgen's metrics.

    python -m bench.hf_baselines --mode static --concurrency 1,32 --output-tokens 200 --json bench/results/hf.json

On a GPU, against a model shape with random weights (bench/model_shapes.py):

    python -m bench.hf_baselines --mode continuous --model /tmp/llama3-8b-shape --load-format dummy \
        --device cuda --dtype bfloat16 --concurrency 64 --output-tokens 200
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/hf_baselines.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.loadgen import format_summary  # noqa: E402
from bench.metrics import LevelSummary, RequestRecord, summarize  # noqa: E402
from bench.prompts import Prompt, load_tokenizer, make_prompts  # noqa: E402
from bench.report import build_report, write_report  # noqa: E402
from bench.workload import Level, Workload, add_workload_args, workload_from_args  # noqa: E402
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StepTimes:
    """A generate() streamer that only notes when each step's tokens came out: put() is called
    once with the prompt, then once per step with that step's tokens of every row."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_static(model, prompts: list[Prompt], level: Level, output_tokens: int, pad_token_id: int) -> list[RequestRecord]:
    """Batches of level.concurrency prompts, one generate() call each, one after another."""
    if level.concurrency is None:
        raise ValueError("a static batch has no request rate: use --concurrency")
    records = []
    for first in range(0, len(prompts), level.concurrency):
        batch = prompts[first:first + level.concurrency]
        input_ids = torch.tensor([p.token_ids for p in batch], device=model.device)  # [B, L]: equal lengths
        streamer = StepTimes()
        start = time.perf_counter()
        with torch.inference_mode():
            # min_new_tokens = max_new_tokens: EOS cannot end a row early (ignore_eos).
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                           max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                           pad_token_id=pad_token_id, streamer=streamer)
        token_times = streamer.times[1:]  # the first put() is the prompt
        for prompt in batch:
            record = RequestRecord(start=start, num_prompt_tokens=len(prompt.token_ids),
                                   num_output_tokens=len(token_times), end=token_times[-1])
            for t in token_times:
                record.add_chunk(t, 1)
            records.append(record)
    return records


def run_continuous(model, prompts: list[Prompt], level: Level, output_tokens: int) -> list[RequestRecord]:
    """One generate_batch() call for all of the level's prompts, at most level.concurrency at once."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if level.request_rate is not None:
        raise ValueError("generate_batch takes all prompts at once: use --concurrency")
    # eos_token_id=-1 disables EOS (ignore_eos); generate_batch has no min_new_tokens.
    generation_config = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=-1,
                                         pad_token_id=model.generation_config.pad_token_id or 0)
    page_size = 256
    pages_per_request = math.ceil((len(prompts[0].token_ids) + output_tokens) / page_size)
    # Sized like tokenwire's engine: every running request's context fits, 2048-token steps.
    # Left to itself it would size the cache from GPU memory.
    cb_config = ContinuousBatchingConfig(**continuous_batching_kwargs(
        ContinuousBatchingConfig, page_size=page_size, max_requests_per_batch=level.concurrency,
        num_blocks=(level.concurrency or len(prompts)) * pages_per_request + 1, max_batch_tokens=2048,
    ))
    called = time.perf_counter()
    outputs = model.generate_batch([p.token_ids for p in prompts], generation_config, cb_config,
                                   record_timestamps=True, progress_bar=False)
    records = []
    for prompt, out in zip(prompts, outputs.values(), strict=True):
        # Timestamps are time.perf_counter() values taken inside generate_batch. Each request's
        # clock starts when it was made (created_time), after the call has built its batching
        # manager, cache and warm-up: counted from the call, that setup was 34-76 ms of every
        # TTFT here, 17-34% of it (review 91).
        record = RequestRecord(start=getattr(out, "created_time", None) or called,
                               num_prompt_tokens=len(prompt.token_ids),
                               num_output_tokens=len(out.generated_tokens), error=out.error)
        for t in out.timestamps or []:
            record.add_chunk(t, 1)
        record.end = record.chunk_times[-1] if record.chunk_times else time.perf_counter()
        records.append(record)
    return records


def continuous_batching_kwargs(config_class, **wanted) -> dict:
    """`wanted` in the names this transformers' ContinuousBatchingConfig takes (some versions call
    the page size `block_size`); a setting it lacks is left to its default, and said so."""
    import inspect

    accepted = inspect.signature(config_class.__init__).parameters
    if "page_size" not in accepted and "block_size" in accepted:
        wanted["block_size"] = wanted.pop("page_size")
    dropped = sorted(set(wanted) - set(accepted))
    if dropped:
        print(f"note: this transformers' ContinuousBatchingConfig has no {', '.join(dropped)}; left to its defaults",
              file=sys.stderr)
    return {name: value for name, value in wanted.items() if name in accepted}


def load_model(model_dir: Path, load_format: str, device: torch.device, dtype: torch.dtype):
    """The checkpoint's weights, or (dummy) transformers' own random init of its config, made
    directly on the device: an 8B model initialised on the host would take minutes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        with device:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["static", "continuous"], required=True,
                        help="static: generate() batches; continuous: generate_batch()")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="'default' (SmolLM2 GGUF), a .gguf or a HF model dir")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "tokenwire"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights from the model dir's config.json (made on --device)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", dest="json_out", default="")
    add_workload_args(parser)
    args = parser.parse_args(argv)
    args.workload = workload_from_args(args, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload: Workload = args.workload
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import __version__ as transformers_version
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about unused generation-config fields every call
    model_dir = resolve_model_dir(args.model, Path(args.cache_dir))
    model = load_model(model_dir, args.load_format, torch.device(args.device), DTYPES[args.dtype])
    pool = make_prompts(load_tokenizer(model_dir), workload.pool_size, workload.prompt_len, workload.seed)
    label = args.label or f"transformers {'generate static' if args.mode == 'static' else 'generate_batch'}"
    pad = model.generation_config.pad_token_id or 0

    def run(prompts: list[Prompt], level: Level, output_tokens: int) -> list[RequestRecord]:
        if args.mode == "static":
            return run_static(model, prompts, level, output_tokens, pad)
        return run_continuous(model, prompts, level, output_tokens)

    summaries: list[LevelSummary] = []
    error = None
    try:
        run(workload.warmup_prompts(pool)[:2], Level(2, None, 2), 4)
        for level in workload.levels():
            summary = summarize(run(level.prompts(pool), level, workload.output_tokens),
                                level.concurrency, level.request_rate)
            print(format_summary(summary), flush=True)
            summaries.append(summary)
    except Exception as exc:  # generate_batch on CPU is young: record why, let the comparison go on
        error = f"{type(exc).__name__}: {exc}"
        print(f"{label} failed: {error}", file=sys.stderr)
    report = build_report(label, f"hf_{args.mode}", asdict(workload), summaries, error=error,
                          dtype=args.dtype, device=args.device, load_format=args.load_format,
                          transformers=transformers_version)
    if args.json_out:
        write_report(Path(args.json_out), report)
        print(f"wrote {args.json_out}")
    return 1 if error or any(s.failed for s in summaries) else 0


if __name__ == "__main__":
    raise SystemExit(main())
