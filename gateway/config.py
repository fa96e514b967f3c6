"""The gateway's one Config, built from flags/env by __main__."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Config:
    """tokenwire gateway: the OpenAI-compatible REST API in front of the two workers."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    model_worker: str = field(default="127.0.0.1:50051", metadata={"help": "model worker gRPC address"})
    detok_workers: list[str] = field(default_factory=lambda: ["127.0.0.1:50052"], metadata={
        "help": "detok worker gRPC addresses, comma-separated; sequences are spread across them"})
    served_model_name: str = field(default="", metadata={
        "help": "model id clients send and see; default: the model worker's model id"})
    startup_timeout_s: float = field(default=300.0, metadata={
        "help": "how long to wait for the workers at start"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def __post_init__(self) -> None:
        if not self.detok_workers:
            raise ValueError("--detok-workers needs at least one address")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, not {self.port}")
