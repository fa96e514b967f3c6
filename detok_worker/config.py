"""The detokenizer worker's one Config, built from flags/env by __main__."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenwire.config_cli import LOG_LEVELS
from tokenwire.grpc_tls import WorkerServerOptions
from tokenwire.loop_watchdog import check_stall_exit_s, stall_exit_field


@dataclass
class Config(WorkerServerOptions):
    """tokenwire detok worker: token-id streams in, exact UTF-8 text deltas out."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50052, metadata={"help": "gRPC port"})
    log_level: str = field(default="info", metadata={"help": ", ".join(LOG_LEVELS), "choices": LOG_LEVELS})
    loop_stall_exit_s: float = stall_exit_field()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_stall_exit_s(self.loop_stall_exit_s)
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, not {self.port}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
