"""The detokenizer worker's one Config, built from flags/env by __main__."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenwire.grpc_tls import server_tls


@dataclass
class Config:
    """tokenwire detok worker: token-id streams in, exact UTF-8 text deltas out."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50052, metadata={"help": "gRPC port"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})
    tls_cert_file: str = field(default="", metadata={"help": "PEM certificate chain; with --tls-key-file serves gRPC over TLS"})
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of --tls-cert-file"})
    tls_client_ca_file: str = field(default="", metadata={
        "help": "PEM CA bundle; set: clients must present a certificate it signed (mTLS)"})
    drain_grace_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM: seconds running requests get to finish before the worker exits"})

    def __post_init__(self) -> None:
        self.tls = server_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, not {self.port}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
