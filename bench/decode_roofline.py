"""Decode step time against the memory-bandwidth roofline (issue 4's GPU target: <= 1.3x at batch 1).

A decode step reads every weight once and each sequence's cached keys and values; at small
batches that traffic, not arithmetic, bounds the step, so the floor is (weight bytes + KV bytes
read) / the device's copy bandwidth. This measures that bandwidth (a large tensor copy: bytes
read + written per second), builds the model with dummy weights (default: a Llama-3-8B-shaped
config in bf16, made on the device), prefills B sequences of --context tokens, and times whole
engine decode steps (scheduler, forward, sampler, the one host sync), eager and, on CUDA,
replayed from CUDA graphs, steps alternating on one engine. On a CPU, --bf16-small-batch adds
steps whose small matmuls run on the bf16 kernel (model_worker/kernels/bf16_linear.cpp) beside
the eager ones on oneDNN; the roofline is the same, since either reads one copy of the weights.

    .venv/bin/python -m bench.decode_roofline --batch-sizes 1,8 --context 512        # CUDA, Llama-3-8B shape
    .venv/bin/python -m bench.decode_roofline --shape smollm2-135m --device cpu --batch-sizes 1
    .venv/bin/python -m bench.decode_roofline --shape smollm2-135m --device cpu --threads 2 --bf16-small-batch
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.bench_packed_linear import linear_layers
from bench.model_shapes import SHAPES, write_shape_dir
from model_worker.engine import LLMEngine
from model_worker.kv_cache import kv_bytes_per_token
from model_worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from model_worker.models.hf_fallback import HFCausalLM
from model_worker.models.linear import BF16_KERNEL_MAX_TOKENS, Linear
from model_worker.sequence import SamplingParams

BLOCK_SIZE = 16  # the model worker's default
STEP_TOKENS = 2048  # the model worker's default --max-num-batched-tokens


@dataclass
class BatchRoofline:
    batch: int
    mean_context: float  # cached positions per sequence, averaged over the timed steps
    weight_bytes: int  # read once per step
    kv_bytes: int  # keys and values the step's attention must read, at mean_context
    roofline_ms: float  # (weight_bytes + kv_bytes) / bandwidth
    step_ms: dict[str, float] = field(default_factory=dict)  # p50 per mode: "eager", "cuda_graphs"
    ratio: dict[str, float] = field(default_factory=dict)  # step_ms / roofline_ms per mode


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Bytes per second a device-to-device tensor copy moves (each byte read once and written once),
    the best of `repeats` copies."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - started
        best = min(best, seconds)
    return 2 * num_bytes / best


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _main_copy(layer: Linear) -> torch.Tensor | None:
    """The copy of a layer's weights that steps over 8 tokens read: plain, oneDNN-packed, or (under
    --cpu-bf16-matmul kernels) the only copy, packed in 4-row blocks."""
    return next((w for w in (layer.weight, layer.packed_weight, layer.bf16_blocks) if w is not None), None)


def weight_bytes_per_step(model) -> int:
    """Bytes of the weights one decode step reads: every layer's, the final norm's and the LM head's
    (the embedding table only by the step's rows, left out; tied, the LM head reads it whole)."""
    total = 0
    for layer in model.layers:
        for value in layer.values():
            if isinstance(value, Linear):
                total += _tensor_bytes(_main_copy(value)) + _tensor_bytes(value.bias)
            elif isinstance(value, torch.Tensor):
                total += _tensor_bytes(value)
            elif isinstance(value, tuple):  # GPT-2's (weight, bias) norms
                total += sum(_tensor_bytes(t) for t in value)
    head = model.lm_head
    total += _tensor_bytes(_main_copy(head))
    final_norm = getattr(model, "norm", None)
    if final_norm is None:
        final_norm = model.ln_f
    total += sum(_tensor_bytes(t) for t in (final_norm if isinstance(final_norm, tuple) else (final_norm,)))
    return total


def time_decode_steps(runner: ModelRunner, batch: int, context: int, steps: int, warmup: int,
                      seed: int = 0, profile_steps: int = 0,
                      kernel_profile_steps: int = 0) -> tuple[dict[str, list[float]], float]:
    """Step times (s) per mode over `steps` decode steps each, modes alternating step by step on one
    engine after `warmup` steps of each; and the mean context length of the timed steps."""
    graphs = runner.decode_graphs
    # --bf16-small-batch's copies beside oneDNN's (under --cpu-bf16-matmul kernels every step is on them).
    kernel_layers = [layer for layer in linear_layers(runner.model)
                     if layer.bf16_blocks is not None and layer.bf16_large is None]
    modes = (["eager"] + (["cuda_graphs"] if graphs is not None and graphs.capture else [])
             + (["bf16_kernel"] if kernel_layers else []))

    def set_mode(mode: str) -> None:
        runner.decode_graphs = graphs if mode == "cuda_graphs" else None
        for layer in kernel_layers:  # eager: oneDNN for every step, as without --bf16-small-batch
            layer.bf16_max_tokens = BF16_KERNEL_MAX_TOKENS if mode == "bf16_kernel" else 0

    engine = LLMEngine(runner, [], max_num_seqs=batch, max_num_batched_tokens=STEP_TOKENS,
                       max_waiting_requests=batch)
    gen = torch.Generator().manual_seed(seed)
    total_steps = (warmup + steps) * len(modes)
    for i in range(batch):
        prompt = torch.randint(100, runner.vocab_size, (context,), generator=gen).tolist()
        # As many tokens as the context allows: the first sequences decode while the last prefill.
        engine.add_request(i, prompt, SamplingParams(), max_tokens=runner.max_model_len - context,
                           stop_token_ids=[], ignore_eos=True)
    started: set[int] = set()
    while len(started) < batch:  # prefill (untimed) until every sequence has its first token
        started.update(out.seq_id for out in engine.step())
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    contexts: list[int] = []
    for step in range(total_steps):
        mode = modes[step % len(modes)]
        set_mode(mode)
        context_now = statistics.fmean(s.num_tokens - 1 for s in engine.scheduler.running)
        began = time.perf_counter()
        outputs = engine.step()  # the sampler's host copy waits for the device: the step is done
        elapsed = time.perf_counter() - began
        if len(outputs) != batch:
            raise RuntimeError(f"a decode step produced {len(outputs)} tokens for {batch} sequences "
                               f"({engine.scheduler.num_preemptions} preemptions so far)")
        if step >= warmup * len(modes):
            times[mode].append(elapsed)
            contexts.append(context_now)
    runner.decode_graphs = graphs
    for layer in kernel_layers:
        layer.bf16_max_tokens = BF16_KERNEL_MAX_TOKENS
    if "cuda_graphs" in modes:
        times["graph_replay"] = replay_times(graphs, batch, max(s.num_tokens - 1 for s in engine.scheduler.running),
                                             steps)
    if profile_steps and "cuda_graphs" in modes:
        profile_host(engine, profile_steps)
    if kernel_profile_steps and runner.device.type == "cuda":
        runner.decode_graphs = None
        profile_kernels(engine, kernel_profile_steps)
        runner.decode_graphs = graphs
    return times, statistics.fmean(contexts)


def profile_kernels(engine: LLMEngine, steps: int) -> None:
    """torch.profiler's GPU kernels over `steps` eager steps (the kernels a graph replays, without
    its launch gaps): per kernel name, time and count, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    print(f"GPU kernels of {steps} eager steps at batch {len(engine.scheduler.running)}: "
          f"{total / 1e3 / steps:.3f} ms per step, {sum(e.count for e in events) / steps:.0f} kernels per step",
          flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms {e.count / steps:6.0f}x  {e.key[:110]}")


def replay_times(graphs, batch: int, context: int, repeats: int) -> list[float]:
    """Seconds per replay of the graph a step of `batch` sequences at `context` uses, timed with
    device events on its last inputs: the forward's GPU time alone, without the step's host work
    (scheduling, buffer fill, sampling, the host copy)."""
    graph = graphs._graphs[graphs.bucket(batch, context)]
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return seconds


def profile_host(engine: LLMEngine, steps: int) -> None:
    """cProfile of `steps` engine steps: where a step's host time goes (printed, top 30 by own time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    print(f"host profile of {steps} steps at batch {len(engine.scheduler.running)} (own time):", flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                        help="a built-in config (dummy weights); ignored with --model-dir")
    parser.add_argument("--model-dir", default=None, help="a model dir with config.json (its weights are not read)")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA and bf16 CPUs), bfloat16, float32")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence before decoding")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per mode")
    parser.add_argument("--warmup", type=int, default=5, help="untimed decode steps per mode first")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: time eager steps only")
    parser.add_argument("--no-cuda-kernels", action="store_true",
                        help="CUDA: torch ops instead of the Triton kernels (the model worker's --no-cuda-kernels)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="CUDA: after each batch's timed steps, cProfile this many graph steps (host time)")
    parser.add_argument("--kernel-profile-steps", type=int, default=0,
                        help="CUDA: then list the GPU kernels of this many eager steps (torch.profiler)")
    parser.add_argument("--bandwidth-bytes", type=int, default=1 << 30, help="size of the copy that measures bandwidth")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    parser.add_argument("--bf16-small-batch", action="store_true",
                        help="CPU, bf16: also time steps on the bf16 small-step kernel (mode bf16_kernel) against "
                             "oneDNN (mode eager); implies --cpu-bf16-matmul onednn")
    parser.add_argument("--cpu-bf16-matmul", choices=["auto", "onednn", "kernels"], default=None,
                        help="CPU, bf16: as the model worker's flag; default auto, as there (onednn with "
                             "--bf16-small-batch)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.cpu_bf16_matmul is None:
        args.cpu_bf16_matmul = "onednn" if args.bf16_small_batch else "auto"
    elif args.bf16_small_batch and args.cpu_bf16_matmul != "onednn":
        parser.error("--bf16-small-batch times the small-step kernel against oneDNN: not with --cpu-bf16-matmul "
                     f"{args.cpu_bf16_matmul}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must list sizes >= 1")
    if args.context < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--context and --steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    bandwidth = copy_bandwidth(device, args.bandwidth_bytes)
    max_batch = max(args.batch_sizes)
    # Prefill steps (when the first sequences already decode), then every mode's steps.
    prefill_steps = -(-max_batch * args.context // STEP_TOKENS) + 1
    max_model_len = args.context + prefill_steps + 2 * (args.warmup + args.steps) + 4 + args.profile_steps + args.kernel_profile_steps
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(args.model_dir) if args.model_dir else write_shape_dir(args.shape, Path(scratch))
        runner = ModelRunner(model_dir, "dummy", device, dtype, max_num_seqs=max_batch, max_model_len=max_model_len,
                             # Room for every sequence's whole context: no preemption mid-run.
                             kv_cache_tokens=max_batch * -(-max_model_len // BLOCK_SIZE) * BLOCK_SIZE,
                             block_size=BLOCK_SIZE,
                             decode_graphs=device.type == "cuda" and not args.no_cuda_graphs,
                             bf16_small_batch=args.bf16_small_batch, cpu_bf16_matmul=args.cpu_bf16_matmul,
                             cuda_kernels=not args.no_cuda_kernels)
    if args.bf16_small_batch and not any(layer.bf16_blocks is not None for layer in linear_layers(runner.model)):
        raise SystemExit("--bf16-small-batch: no bf16 kernel here (needs --dtype bfloat16 on a CPU with AVX512-BF16 "
                         "and a C++ compiler)")
    if isinstance(runner.model, HFCausalLM):
        raise SystemExit(f"{model_dir}: architectures {runner.shape.architectures} run through the transformers "
                         "fallback, whose weights this bench cannot count; use a Llama-family or GPT-2 config")
    s = runner.shape
    per_token = kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, dtype)
    weights = weight_bytes_per_step(runner.model)
    name = args.model_dir or args.shape
    print(f"{name} ({weights / 2**30:.2f} GiB of weights per step) {dtype} on {device}; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; context {args.context}, {args.steps} timed steps per mode", flush=True)
    results: list[BatchRoofline] = []
    for batch in args.batch_sizes:
        times, mean_context = time_decode_steps(runner, batch, args.context, args.steps, args.warmup,
                                                profile_steps=args.profile_steps,
                                                kernel_profile_steps=args.kernel_profile_steps)
        # Each sequence's step reads its cached positions and the new token's (written, then read).
        kv = round(batch * (mean_context + 1) * per_token)
        result = BatchRoofline(batch, mean_context, weights, kv, 1e3 * (weights + kv) / bandwidth)
        for mode, samples in times.items():
            result.step_ms[mode] = 1e3 * statistics.median(samples)
            result.ratio[mode] = result.step_ms[mode] / result.roofline_ms
        results.append(result)
        line = ", ".join(f"{m} {result.step_ms[m]:.3f} ms = {result.ratio[m]:.2f}x" for m in result.step_ms)
        print(f"batch {batch}: roofline {result.roofline_ms:.3f} ms; {line}", flush=True)
    report = {"model": name, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "copy_bandwidth_bytes_per_s": bandwidth,
              "kv_bytes_per_token": per_token, "context": args.context, "steps": args.steps,
              "torch": torch.__version__, "results": [asdict(r) for r in results]}
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
