"""The gateway's one Config, built from flags/env by __main__."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.reasoning_parsers import REASONING_PARSERS
from gateway.request_limits import RequestLimits
from gateway.tool_parsers import TOOL_CALL_PARSERS
from tokenwire.config_cli import LOG_LEVELS
from tokenwire.grpc_tls import client_tls
from tokenwire.loop_watchdog import check_stall_exit_s, stall_exit_field
from tokenwire.sched_slice import SchedSliceOption

# A --model-workers entry the gateway resolves itself, one replica per address.
DNS_SCHEME = "dns:///"


def dns_name(address: str, flag: str = "--model-workers") -> tuple[str, int] | None:
    """(host, port) of a `dns:///HOST:PORT` entry; None for an address gRPC dials as given (one
    replica). Raises ValueError for a `dns:` entry of another shape."""
    if not address.startswith("dns:"):
        return None
    host, _, port = address.removeprefix(DNS_SCHEME).rpartition(":")
    if not address.startswith(DNS_SCHEME) or not host or not port.isdigit():
        raise ValueError(f"{flag}: {address!r}: expected dns:///HOST:PORT (no DNS authority)")
    return host.strip("[]"), int(port)


# gRPC target schemes other than dns: taken as given (grpc checks them).
OTHER_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def check_worker_address(address: str, flag: str) -> None:
    """Raises ValueError for an entry gRPC would only fail to reach after --startup-timeout-s: a
    dns: entry of another shape, or HOST:PORT without a port in 1..65535."""
    if dns_name(address, flag) is not None or address.startswith(OTHER_SCHEMES):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: {address!r}: expected HOST:PORT (a port in 1..65535) or dns:///HOST:PORT")


@dataclass
class Config(SchedSliceOption):
    """tokenwire gateway: the OpenAI-compatible REST API in front of the two workers."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    model_workers: list[str] = field(default_factory=lambda: ["127.0.0.1:50051"], metadata={
        "help": "model worker gRPC addresses, comma-separated, all serving the same model; each request goes "
                "to the least-loaded connected one. A dns:///HOST:PORT entry (a Kubernetes headless Service) "
                "is resolved by the gateway into one replica per address, again every "
                "--model-worker-dns-refresh-s"})
    model_worker_dns_refresh_s: float = field(default=10.0, metadata={
        "help": "seconds between DNS lookups of dns:/// --model-workers entries (pods joining and leaving)"})
    detok_workers: list[str] = field(default_factory=lambda: ["127.0.0.1:50052"], metadata={
        "help": "detok worker gRPC addresses, comma-separated; each sequence goes to the least-loaded connected "
                "one. A dns:///HOST:PORT entry is resolved by the gateway into one replica (one stream) per "
                "address, again every --detok-worker-dns-refresh-s"})
    detok_worker_dns_refresh_s: float = field(default=10.0, metadata={
        "help": "seconds between DNS lookups of dns:/// --detok-workers entries (pods joining and leaving)"})
    served_model_name: str = field(default="", metadata={
        "help": "model id clients send and see; default: the model worker's model id"})
    startup_timeout_s: float = field(default=300.0, metadata={
        "help": "how long to wait for the workers at start"})
    detok_warmup_timeout_s: float = field(default=10.0, metadata={
        "help": "before each detok stream opens, how long the replica may take to load the model's tokenizer "
                "(one RenderTokens); past it the stream opens anyway and the first request waits for the load"})
    log_level: str = field(default="info", metadata={"help": ", ".join(LOG_LEVELS), "choices": LOG_LEVELS})
    api_key: list[str] = field(default_factory=list, metadata={
        "help": "API keys clients must send (Authorization: Bearer KEY), comma-separated; empty: no check"})
    cors_allow_origins: list[str] = field(default_factory=list, metadata={
        "help": "origins browsers may call from, comma-separated ('*' for any); empty: no CORS headers"})
    worker_tls_ca_file: str = field(default="", metadata={
        "help": "PEM CA bundle that signed the workers' certificates; set: gRPC to the workers uses TLS"})
    worker_tls_cert_file: str = field(default="", metadata={
        "help": "PEM client certificate for workers that require mTLS (with --worker-tls-key-file)"})
    worker_tls_key_file: str = field(default="", metadata={"help": "PEM private key of --worker-tls-cert-file"})
    worker_tls_server_name: str = field(default="", metadata={
        "help": "name to expect in the workers' certificates when their addresses are IPs"})
    tls_cert_file: str = field(default="", metadata={"help": "PEM certificate; with --tls-key-file serves HTTPS"})
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of --tls-cert-file"})
    drain_grace_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM: seconds open requests get to finish before the gateway exits"})
    loop_stall_exit_s: float = stall_exit_field()
    request_timeout_s: float = field(default=600.0, metadata={
        "help": "a request still running after this many seconds is aborted with a 504 (or a final SSE error "
                "event); 0: no limit"})
    max_body_bytes: int = field(default=8 << 20, metadata={"help": "larger request bodies get a 413"})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings per request"})
    max_stop_string_chars: int = field(default=512, metadata={"help": "longest stop string, in characters"})
    max_logit_bias_entries: int = field(default=1024, metadata={"help": "most logit_bias entries per request"})
    max_bad_words: int = field(default=256, metadata={"help": "most bad_words per request"})
    max_token_id_list: int = field(default=8192, metadata={
        "help": "most entries in allowed_token_ids or stop_token_ids"})

    tool_call_parser: str = field(default="", metadata={
        "help": "the syntax the model writes tool calls in (hermes: Hermes 2 Pro, Qwen2.5, Qwen3); set, "
                'tool_choice "auto" (the default with tools) is served and the calls are found in the output; '
                'empty: "auto" is a 400 and only forced calls (required, a named function) are served'})

    exclude_tools_when_tool_choice_none: bool = field(default=False, metadata={
        "help": 'leave the tools out of the chat template with tool_choice "none" (vLLM\'s flag); by default the '
                "template still shows them, as OpenAI and vLLM do: the model knows them but may not call one"})

    reasoning_parser: str = field(default="", metadata={
        "help": "how the model marks its thinking (deepseek_r1: DeepSeek R1, QwQ, Qwen3 thinking models whose "
                "template opens <think> in the prompt; qwen3: Qwen3, reasoning only after an opening <think>); set, "
                "chat answers carry it apart from the content, as `reasoning` (and `reasoning_content`)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.limits = RequestLimits(self.max_body_bytes, self.max_stop_strings, self.max_stop_string_chars,
                                    self.max_logit_bias_entries, self.max_bad_words, self.max_token_id_list,
                                    self.request_timeout_s)
        if self.request_timeout_s < 0 or min(self.max_body_bytes, self.max_stop_strings, self.max_stop_string_chars,
                                             self.max_logit_bias_entries, self.max_bad_words,
                                             self.max_token_id_list) < 1:
            raise ValueError("--request-timeout-s must be >= 0 and every --max-* limit >= 1")
        self.worker_tls = client_tls(self.worker_tls_ca_file, self.worker_tls_cert_file,
                                     self.worker_tls_key_file, self.worker_tls_server_name)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if not self.model_workers:
            raise ValueError("--model-workers needs at least one address")
        for address in self.model_workers:
            check_worker_address(address, "--model-workers")
        if len(set(self.model_workers)) != len(self.model_workers):
            raise ValueError("--model-workers lists an address twice (each entry is one replica, or one DNS name)")
        for flag in ("model_worker_dns_refresh_s", "detok_worker_dns_refresh_s"):
            if not getattr(self, flag) > 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
        if self.detok_warmup_timeout_s <= 0:
            raise ValueError("--detok-warmup-timeout-s must be > 0")
        if not self.detok_workers:
            raise ValueError("--detok-workers needs at least one address")
        for address in self.detok_workers:
            check_worker_address(address, "--detok-workers")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser: {self.tool_call_parser!r} is not one of "
                             f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: {self.reasoning_parser!r} is not one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, not {self.port}")
        if not self.startup_timeout_s > 0:  # 0 or less gave up on the workers at once
            raise ValueError(f"--startup-timeout-s must be > 0, not {self.startup_timeout_s}")
        if not self.drain_grace_s >= 0:
            raise ValueError(f"--drain-grace-s must be >= 0, not {self.drain_grace_s}")
        check_stall_exit_s(self.loop_stall_exit_s)
