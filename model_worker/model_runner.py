"""Owns the model weights and KV cache, and runs one scheduled step's forward pass.

Picks the model by config.json's `architectures`: the Llama family (llama.py) and GPT-2
(gpt2.py) run natively over the paged KV cache from safetensors read directly (or random
weights for benchmarks); any other causal LM runs through transformers (hf_fallback.py, slower).
Returns the logits of rows that need a new token.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file

from model_worker.attention_metadata import AttentionMetadata
from model_worker.cuda_graphs import DecodeGraphRunner
from model_worker.device_transfer import tensor_on
from model_worker.kernels import (
    DEFAULT_BUILD_ROOT,
    bf16_linear_module,
    gguf_linear_module,
    int8_linear_module,
    llama_ops_module,
    paged_decode_attention_fits,
    paged_decode_attention_module,
    sampling_ops_module,
)
from model_worker.kv_cache import PagedKVCache, kv_bytes_per_token, num_kv_blocks
from model_worker.models import gpt2
from model_worker.models.gpt2 import GPT2Model, GPT2Shape
from model_worker.models.hf_fallback import CacheBudget, HFCausalLM, HFShape
from model_worker.models.linear import (
    KERNEL_MATMUL_MIN_SPEEDUP,
    LARGE_STEP_KERNELS,
    Linear,
    kernel_matmul_times,
)
from model_worker.models.llama import SUPPORTED_ARCHITECTURES as LLAMA_ARCHITECTURES
from model_worker.models.llama import LlamaModel, LlamaShape
from model_worker.scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def triton_ops_module() -> ModuleType | None:
    """model_worker.triton_ops, or None where triton is not installed (a CUDA torch ships it)."""
    try:
        from model_worker import triton_ops
    except ImportError as exc:
        logger.warning("no triton (%s): CUDA steps use torch ops for the norms, rotary and decode attention", exc)
        return None
    return triton_ops


def native_linear_layers(model: LlamaModel | GPT2Model) -> list[Linear]:
    """Every Linear of a natively run model: its layers' and the lm_head."""
    return [value for layer in model.layers for value in layer.values() if isinstance(value, Linear)] + [model.lm_head]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 dot products in hardware (AVX512-BF16 or AMX).

    Without them oneDNN emulates bf16 and is slower than float32, so "auto" must not pick it.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 wherever the hardware runs it natively: on this project's AVX512-BF16 CPUs its
        # GEMMs measured 3.4-6x faster than float32 at 32 tokens (bench/README.md), and it halves
        # the KV cache. float32 elsewhere on CPU; --dtype float32 gives transformers' exact greedy.
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[dtype]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def model_shape(config: dict) -> LlamaShape | GPT2Shape | HFShape:
    """The native shape for config.json's architectures, else HFShape (the transformers path)."""
    archs = config.get("architectures") or []
    if any(a in LLAMA_ARCHITECTURES for a in archs):
        return LlamaShape.from_config(config)
    if any(a in gpt2.SUPPORTED_ARCHITECTURES for a in archs):
        return GPT2Shape.from_config(config)
    return HFShape.from_config(config)


def dummy_weights(shape: LlamaShape | GPT2Shape, seed: int = 0, device: torch.device | None = None,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights with the checkpoint's names and shapes (std 0.02, norms at 1), made on
    `device` in `dtype` (Llama family; GPT-2's are made on the CPU in float32)."""
    if isinstance(shape, GPT2Shape):
        return gpt2.dummy_weights(shape, seed)
    device = device or torch.device("cpu")
    gen = torch.Generator(device).manual_seed(seed)
    s = shape

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen, device=device, dtype=dtype) * 0.02

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=dtype)

    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    weights = {"model.embed_tokens.weight": rand(s.vocab_size, s.hidden_size),
               "model.norm.weight": ones(s.hidden_size)}
    if not s.tie_word_embeddings:
        weights["lm_head.weight"] = rand(s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(q, s.hidden_size),
            p + "self_attn.k_proj.weight": rand(kv, s.hidden_size),
            p + "self_attn.v_proj.weight": rand(kv, s.hidden_size),
            p + "self_attn.o_proj.weight": rand(s.hidden_size, q),
            p + "mlp.gate_proj.weight": rand(s.intermediate_size, s.hidden_size),
            p + "mlp.up_proj.weight": rand(s.intermediate_size, s.hidden_size),
            p + "mlp.down_proj.weight": rand(s.hidden_size, s.intermediate_size),
            p + "input_layernorm.weight": ones(s.hidden_size),
            p + "post_attention_layernorm.weight": ones(s.hidden_size),
        })
        if s.attention_bias:
            weights.update({p + f"self_attn.{n}_proj.bias": rand(d) for n, d in (("q", q), ("k", kv), ("v", kv))})
        if s.o_bias:
            weights[p + "self_attn.o_proj.bias"] = rand(s.hidden_size)
        if s.mlp_bias:
            weights.update({p + f"mlp.{n}_proj.bias": rand(d) for n, d in
                            (("gate", s.intermediate_size), ("up", s.intermediate_size), ("down", s.hidden_size))})
        if s.qk_norm:
            weights.update({p + f"self_attn.{n}_norm.weight": ones(s.head_dim) for n in "qk"})
    return weights


@dataclass
class StepLogits:
    logits: torch.Tensor  # [S, V] float32, one row per chunk that completes its sequence
    chunk_indices: list[int]  # index into SchedulerOutput.chunks for each row
    # Extra output, only for chunks whose sequence asked for prompt logprobs.
    prompt_logits: list[PromptChunkLogits] = field(default_factory=list)


@dataclass
class PromptChunkLogits:
    """Logits after every prompt position of one chunk that predicts another prompt token."""

    chunk_index: int  # into SchedulerOutput.chunks
    first_position: int  # row j follows prompt position first_position + j
    logits: torch.Tensor  # [n, V] float32


class ModelRunner:
    def __init__(self, model_dir: Path, load_format: str, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, max_model_len: int, block_size: int = 16, kv_cache_tokens: int = 0,
                 kv_cache_memory_bytes: int = 0, gpu_memory_utilization: float = 0.9,
                 int8_small_batch: bool = False, batch_invariant: bool = False,
                 cpu_decode_kernel: bool = True, kernel_build_root: Path = DEFAULT_BUILD_ROOT,
                 decode_graphs: bool = False, bf16_small_batch: bool = False,
                 cpu_bf16_matmul: str = "onednn", int4_small_batch: bool = False,
                 q8_0_lm_head: bool = False, cuda_kernels: bool = True) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.shape = model_shape(config)
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        s = self.shape
        if batch_invariant and not isinstance(s, LlamaShape):
            raise ValueError("--batch-invariant is implemented for the Llama family only, "
                             f"not architectures {config.get('architectures')}")
        # The C++ kernels where they build (--cpu-decode-kernel covers all of them): the int8 matmul,
        # and the bf16 ones (decode attention, the Llama layers' small ops, the small-step matmul),
        # which batch-invariant mode leaves to the torch ops it was checked with.
        cpu_kernels = cpu_decode_kernel and device.type == "cpu"
        bf16_cpu_kernels = cpu_kernels and dtype == torch.bfloat16 and not batch_invariant
        # Their GPU counterparts (Triton), likewise left out of batch-invariant mode.
        gpu_kernels = triton_ops_module() if cuda_kernels and device.type == "cuda" and not batch_invariant else None
        if gpu_kernels is not None and not gpu_kernels.small_ops_run_here(device, dtype):
            gpu_kernels = None
        if isinstance(s, HFShape):
            logger.warning("architectures %s have no native model here: running them through transformers, "
                           "one sequence at a time, without prefix caching (slower)", s.architectures)
            if int8_small_batch or bf16_small_batch or int4_small_batch:
                flag = ("--int8-small-batch" if int8_small_batch else
                        "--int4-small-batch" if int4_small_batch else "--bf16-small-batch")
                natives = "the Llama family" if int4_small_batch else "natively run architectures (Llama family, GPT-2)"
                raise ValueError(f"{flag} is only for {natives}, not the transformers fallback")
            self.model = HFCausalLM(model_dir, s, load_format, device, dtype)
        else:
            if isinstance(s, GPT2Shape):
                if max_model_len > s.max_position_embeddings:
                    raise ValueError(f"--max-model-len {max_model_len} is beyond GPT-2's {s.max_position_embeddings} "
                                     "learned positions (n_positions)")
            else:
                # Rotary tables only need the positions we will ever use.
                s.max_position_embeddings = max(s.max_position_embeddings, max_model_len)
            # Dummy weights on a GPU are made there in the model's dtype: an 8B model's in float32 on
            # the host would take 32 GB and a minute of randn. On a CPU, float32 as always (the
            # tests' seeded weights).
            on_gpu = device.type == "cuda"
            weights = (dummy_weights(s, device=device if on_gpu else None, dtype=dtype if on_gpu else torch.float32)
                       if load_format == "dummy" else load_weights(model_dir))
            int8_kernel = int8_linear_module(kernel_build_root) if cpu_kernels and int8_small_batch else None
            bf16_kernel, bf16_large_steps = self._bf16_matmul(bf16_cpu_kernels, kernel_build_root, bf16_small_batch,
                                                              cpu_bf16_matmul)
            gguf_kernel = None
            if int4_small_batch:
                if isinstance(s, GPT2Shape):
                    raise ValueError("--int4-small-batch is for the Llama family, not GPT-2")
                gguf_kernel = gguf_linear_module(kernel_build_root) if bf16_cpu_kernels else None
                if gguf_kernel is None:
                    logger.warning("--int4-small-batch: no int4 matmul kernel here (needs bfloat16 weights on the CPU, "
                                   "AVX512-VNNI, a C++ compiler and --cpu-decode-kernel); small steps use bf16")
            if isinstance(s, GPT2Shape):
                self.model = GPT2Model(s, weights, device, dtype, int8_small_batch, int8_kernel, bf16_kernel,
                                       bf16_large_steps)
            else:
                llama_ops = llama_ops_module(kernel_build_root) if bf16_cpu_kernels else gpu_kernels
                self.model = LlamaModel(s, weights, device, dtype, int8_small_batch, batch_invariant, int8_kernel,
                                        llama_ops, bf16_kernel, bf16_large_steps, gguf_kernel,
                                        "q8_0" if q8_0_lm_head and gguf_kernel is not None else None)
        attention_kernel = matmul_kernel = False
        if gpu_kernels is not None and not isinstance(s, HFShape):
            attention_kernel, matmul_kernel = gpu_kernels.kernels_run_here(device, dtype, s.num_heads, s.num_kv_heads,
                                                                           s.head_dim)
        if matmul_kernel:
            for layer in native_linear_layers(self.model):
                layer.small_batch_matmul = gpu_kernels.small_batch_linear
                layer.small_batch_max_tokens = gpu_kernels.SMALL_BATCH_MAX_ROWS
        # The sampler's greedy and sampled picks and top_p on the CPU (any dtype: they read the float32 logits).
        sampling_ops = sampling_ops_module(kernel_build_root) if cpu_kernels else None
        self.argmax: Callable[[torch.Tensor], torch.Tensor] | None = (
            sampling_ops.argmax_rows if sampling_ops is not None else None)
        self.gumbel_argmax: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = (
            sampling_ops.gumbel_argmax_rows if sampling_ops is not None else None)
        self.top_p_rows: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = (
            sampling_ops.top_p_rows if sampling_ops is not None else None)
        if decode_graphs:
            if isinstance(s, HFShape):
                raise ValueError("CUDA graphs are only for natively run architectures (Llama family, GPT-2), "
                                 f"not {s.architectures}")
            if batch_invariant:
                raise ValueError("CUDA graphs pad the batch to captured sizes; they cannot be batch-invariant")
        self.sliding_window = s.sliding_window if isinstance(s, LlamaShape) else 0
        # The captured graphs keep the largest decode bucket's peak memory: measured here, it is
        # left out of the KV cache's share of the GPU (vLLM profiles a run for the same reason).
        graph_bytes = (self._largest_decode_bucket_bytes(max_num_seqs, max_model_len, block_size)
                       if decode_graphs and device.type == "cuda" and not kv_cache_tokens and not kv_cache_memory_bytes
                       else 0)
        # Sized after the weights are on the device, so a CUDA budget sees what is left.
        bytes_per_token = kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, dtype)
        num_blocks = num_kv_blocks(bytes_per_token, block_size, max_num_seqs, max_model_len, device, kv_cache_tokens,
                                   kv_cache_memory_bytes, gpu_memory_utilization, graph_bytes)
        if isinstance(s, HFShape):
            self.kv_cache = CacheBudget(num_blocks, block_size, num_blocks * block_size * bytes_per_token)
        else:
            self.kv_cache = PagedKVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype,
                                         device, padding_block=decode_graphs)
            if bf16_cpu_kernels and paged_decode_attention_fits(s.head_dim, s.num_heads // s.num_kv_heads):
                kernels = paged_decode_attention_module(kernel_build_root)
                self.kv_cache.decode_kernel = kernels.paged_decode_attention if kernels is not None else None
            elif attention_kernel:
                self.kv_cache.decode_kernel = gpu_kernels.paged_decode_attention
        logger.info("model %s on %s/%s, KV cache %d blocks x %d tokens = %.1f MiB", model_dir.name, device,
                    dtype, num_blocks, block_size, self.kv_cache.num_bytes / 2**20)
        # decode_graphs: decode steps through DecodeGraphRunner, captured as CUDA graphs on a GPU
        # (on a CPU the same padded static-shape forward runs eagerly: the tests' way in).
        self.decode_graphs: DecodeGraphRunner | None = None
        if decode_graphs:
            self.decode_graphs = self._captured_decode_graphs(max_num_seqs, max_model_len)

    @staticmethod
    def _bf16_matmul(kernels_apply: bool, kernel_build_root: Path, bf16_small_batch: bool,
                     cpu_bf16_matmul: str) -> tuple[ModuleType | None, str]:
        """(bf16_linear_module() or None, Linear's bf16_large_steps) from --bf16-small-batch and
        --cpu-bf16-matmul; kernels_apply: bf16 weights on the CPU with the C++ kernels on. With
        --int8-small-batch (never beside --bf16-small-batch) the kernels take only the steps the int8
        copy does not. The module is built only where a flag may use it."""
        if not bf16_small_batch and cpu_bf16_matmul == "onednn":
            return None, "onednn"
        kernel = bf16_linear_module(kernel_build_root) if kernels_apply else None
        if kernel is None:
            asked = [flag for flag, on in (("--bf16-small-batch", bf16_small_batch),
                                           ("--cpu-bf16-matmul kernels", cpu_bf16_matmul == "kernels")) if on]
            if asked:
                logger.warning("%s: no bf16 matmul kernel here (needs bfloat16 weights on the CPU, AVX512-BF16, a C++ "
                               "compiler and --cpu-decode-kernel); every step uses oneDNN", " and ".join(asked))
            return None, "onednn"
        large_steps = "onednn"
        if cpu_bf16_matmul != "onednn":
            times = kernel_matmul_times(kernel)
            fastest = min(LARGE_STEP_KERNELS, key=times.__getitem__)
            speedup = times["onednn"] / times[fastest]
            use_kernels = cpu_bf16_matmul == "kernels" or speedup >= KERNEL_MATMUL_MIN_SPEEDUP
            logger.info("--cpu-bf16-matmul %s: a 256-row bf16 product ran in %s; %s", cpu_bf16_matmul,
                        ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in times.items()),
                        f"using the kernels, {fastest} for steps over 8 tokens" if use_kernels else "using oneDNN")
            if use_kernels:
                large_steps = fastest
        return (kernel if large_steps != "onednn" or bf16_small_batch else None), large_steps

    def _largest_decode_bucket_bytes(self, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
        """Device memory the graphs will hold (CUDA): the largest decode bucket's forward, run on a
        one-block cache (every block table entry is block 0, and the gather's size does not
        depend on which block it reads), with the runner's own buffers (the probe's stand in
        for them), as the allocator reserved it (its rounding included). 0 when even that does
        not fit: capture then leaves out the buckets that do not."""
        s = self.shape
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_reserved(self.device)
        try:
            probe_cache = PagedKVCache(s.num_layers, 1, block_size, s.num_kv_heads, s.head_dim, self.dtype,
                                       self.device, padding_block=True)
            probe = DecodeGraphRunner(self.model, probe_cache, max_num_seqs, max_model_len, s.vocab_size,
                                      self.device, self.sliding_window, capture=False)
            probe.warm_up_largest()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_reserved(self.device) - before
        except torch.cuda.OutOfMemoryError:
            logger.warning("the largest decode bucket's forward does not fit next to the weights; no memory is "
                           "kept for CUDA graphs")
            peak = 0
        probe = probe_cache = None
        torch.cuda.empty_cache()
        logger.info("CUDA graphs: %.1f MiB kept out of the KV cache (the largest decode bucket's peak)", peak / 2**20)
        return peak

    def _captured_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> DecodeGraphRunner | None:
        graphs = DecodeGraphRunner(self.model, self.kv_cache, max_num_seqs, max_model_len, self.shape.vocab_size,
                                   self.device, self.sliding_window)
        if not graphs.capture:
            return graphs
        started = time.perf_counter()
        try:
            graphs.capture_all()
            error = graphs.check_replays()
        except Exception:
            # A model op that cannot be captured must not take the worker down: it runs eagerly.
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            torch.cuda.empty_cache()
            return None
        # The checks' eager forwards left their peak memory in torch's allocator cache: back to the device.
        torch.cuda.empty_cache()
        logger.info("captured %d decode CUDA graphs (batch sizes %s x widths %s blocks) in %.1f s; replay vs "
                    "eager: worst |logit difference| %.2g of the largest", graphs.num_graphs, graphs.batch_sizes,
                    graphs.widths, time.perf_counter() - started, error)
        return graphs

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def supports_prefix_caching(self) -> bool:
        """False on the transformers path, whose per-sequence caches share no blocks."""
        return not isinstance(self.model, HFCausalLM)

    def engine_idle(self) -> None:
        """The engine's last sequence ended (finished or aborted): the transformers path drops
        the caches of ended sequences now, not at the next request's step (an idle worker held
        them); while others run, they go at the next step, once forked samples took their copies."""
        if isinstance(self.model, HFCausalLM):
            self.model.drop_freed_caches()

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> StepLogits:
        if isinstance(self.model, HFCausalLM):
            return self._execute_per_sequence(self.model, scheduled)
        if scheduled.block_copies:
            src = tensor_on(self.device, [c.src for c in scheduled.block_copies], torch.long)
            dst = tensor_on(self.device, [c.dst for c in scheduled.block_copies], torch.long)
            self.kv_cache.copy_blocks(src, dst)
        decode_chunks = scheduled.decodes
        if self.decode_graphs is not None and decode_chunks and not scheduled.prefills:
            # A decode's chunk is its last token: every row completes its sequence, and no prompt logits.
            logits = self.decode_graphs.run([(c.seq.block_table, c.start) for c in decode_chunks],
                                            [c.seq.token_ids_from(c.start, 1)[0] for c in decode_chunks])
            if logits is not None:
                return StepLogits(logits, list(range(len(decode_chunks))))
        input_ids: list[int] = []
        prefills: list[tuple[list[int], int, int]] = []
        decodes: list[tuple[list[int], int]] = []
        last_rows: list[int] = []
        chunk_indices: list[int] = []
        row = 0
        for i, chunk in enumerate(scheduled.chunks):
            input_ids.extend(chunk.seq.token_ids_from(chunk.start, chunk.num_tokens))
            if i < len(scheduled.prefills):
                prefills.append((chunk.seq.block_table, chunk.start, chunk.num_tokens))
            else:
                decodes.append((chunk.seq.block_table, chunk.start))
            row += chunk.num_tokens
            if chunk.completes_sequence:
                last_rows.append(row - 1)
                chunk_indices.append(i)
        meta = AttentionMetadata.build(prefills, decodes, self.kv_cache.block_size, self.device, self.sliding_window)
        ids = tensor_on(self.device, input_ids, torch.long)
        hidden = self.model.forward(ids, meta, self.kv_cache)  # [T, hidden]
        rows = tensor_on(self.device, last_rows, torch.long)
        return StepLogits(self.model.logits(hidden[rows]), chunk_indices, self._prompt_logits(scheduled, hidden))

    def _prompt_logits(self, scheduled: SchedulerOutput, hidden: torch.Tensor) -> list[PromptChunkLogits]:
        """hidden [T, hidden] -> logits of the prompt positions of chunks that want prompt logprobs
        (rows are laid out in chunk order, as execute() built them)."""
        out: list[PromptChunkLogits] = []
        row = 0
        for i, chunk in enumerate(scheduled.chunks):
            n = num_prompt_logit_rows(chunk)
            if n:
                out.append(PromptChunkLogits(i, chunk.start, self.model.logits(hidden[row:row + n])))
            row += chunk.num_tokens
        return out

    @staticmethod
    def _execute_per_sequence(model: HFCausalLM, scheduled: SchedulerOutput) -> StepLogits:
        """The transformers path: one forward per chunk on that sequence's own cache."""
        chunks = scheduled.chunks
        model.begin_step([(c.seq, c.start) for c in chunks])
        rows: list[torch.Tensor] = []
        chunk_indices: list[int] = []
        prompt_logits: list[PromptChunkLogits] = []
        for i, chunk in enumerate(chunks):
            n = num_prompt_logit_rows(chunk)
            logits = model.forward_chunk(chunk.seq, chunk.start, chunk.num_tokens,
                                         keep=chunk.num_tokens if n else 1)  # [keep, V]
            if n:
                prompt_logits.append(PromptChunkLogits(i, chunk.start, logits[:n]))
            if chunk.completes_sequence:
                rows.append(logits[-1])
                chunk_indices.append(i)
        logits = torch.stack(rows) if rows else torch.empty(0, model.shape.vocab_size, device=model.device)
        return StepLogits(logits, chunk_indices, prompt_logits)


def num_prompt_logit_rows(chunk: ScheduledChunk) -> int:
    """How many of the chunk's first positions need logits for prompt logprobs (0: none)."""
    seq = chunk.seq
    # Not again for a prompt recomputed after preemption: its logprobs went out already.
    if seq.sampling.prompt_logprobs is None or seq.output_token_ids:
        return 0
    # Position p predicts p + 1; only predictions of prompt tokens are prompt logprobs.
    return max(0, min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1) - chunk.start)
