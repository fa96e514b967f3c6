"""TLS and mTLS for every gRPC hop: server credentials for both workers, channel credentials for
the gateway (and the stack launcher's health probes), all built from PEM file flags.

Each service's Config holds the file paths and calls server_tls()/client_tls() in __post_init__,
so a missing or half-given file pair is a flag error at start, never a handshake failure later.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tokenwire.sched_slice import SchedSliceOption


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class ServerTLS:
    """A worker's certificate chain and key; with client_ca_file, clients must present a
    certificate signed by that CA (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = _read(self.client_ca_file, "--tls-client-ca-file") if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(_read(self.key_file, "--tls-key-file"), _read(self.cert_file, "--tls-cert-file"))],
            root_certificates=client_ca, require_client_auth=client_ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """How a client verifies a worker (ca_file) and, for mTLS, proves who it is (cert/key)."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    # Expected name in the worker's certificate when the address is not that name (an IP,
    # or a Kubernetes pod address behind a headless Service).
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "--worker-tls-ca-file"),
            private_key=_read(self.key_file, "--worker-tls-key-file") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "--worker-tls-cert-file") if self.cert_file else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def check_pem(cert_file: str, key_file: str, ca_file: str, flags: tuple[str, str, str]) -> None:
    """Raises ValueError unless the key belongs to the certificate and the CA file holds
    certificates: grpc takes any bytes here and fails each handshake later, which a client saw
    only as DEADLINE_EXCEEDED after its whole --startup-timeout-s."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)

    def no_passphrase() -> str:  # else ssl asks for one on a terminal, or fails as a bare OSError
        raise ValueError("it is encrypted: grpc takes unencrypted PEM keys only")

    if cert_file and key_file:
        try:
            context.load_cert_chain(cert_file, key_file, password=no_passphrase)
        except (ssl.SSLError, ValueError, OSError) as exc:
            raise ValueError(f"{flags[1]} {key_file!r} does not load as the private key of {flags[0]} {cert_file!r} "
                             f"(a key of another certificate, or not PEM): {exc}") from exc
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"{flags[2]} {ca_file!r} holds no PEM certificate: {exc}") from exc


def server_tls(cert_file: str, key_file: str, client_ca_file: str) -> ServerTLS | None:
    """None (plaintext) when no file is given; raises ValueError on a half-given or unreadable set."""
    if not (cert_file or key_file or client_ca_file):
        return None
    if not (cert_file and key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together (--tls-client-ca-file needs both)")
    tls = ServerTLS(cert_file, key_file, client_ca_file)
    tls.credentials()  # reads every file now: a bad path is a start-up error
    check_pem(cert_file, key_file, client_ca_file, ("--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"))
    return tls


def client_tls(ca_file: str, cert_file: str, key_file: str, server_name: str) -> ClientTLS | None:
    """None (plaintext) when no file is given; raises ValueError on a half-given or unreadable set."""
    if not (ca_file or cert_file or key_file):
        if server_name:
            raise ValueError("--worker-tls-server-name needs --worker-tls-ca-file")
        return None
    if not ca_file:
        raise ValueError("--worker-tls-ca-file is needed to verify the workers' certificates")
    if bool(cert_file) != bool(key_file):
        raise ValueError("--worker-tls-cert-file and --worker-tls-key-file go together (mTLS)")
    tls = ClientTLS(ca_file, cert_file, key_file, server_name)
    tls.credentials()
    check_pem(cert_file, key_file, ca_file, ("--worker-tls-cert-file", "--worker-tls-key-file", "--worker-tls-ca-file"))
    return tls


def add_port(server: grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    """Binds address, TLS when configured; raises OSError when the port is taken."""
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.credentials())
    except RuntimeError as exc:  # grpcio >= 1.8x raises this itself ("Failed to bind to address ...")
        raise OSError(f"could not bind {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"could not bind {address}")
    return port


def check_bindable(host: str, port: int) -> None:
    """Raises OSError (with the address) unless host:port can be bound now: checked before a
    worker loads its model, so a port in use fails in a moment instead of after the load.
    Port 0 (any free one) always can."""
    if port == 0:
        return
    try:
        # "[::1]" as the workers' --host writes an IPv6 address for grpc; "" is the wildcard.
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]") or None, port,
                                                             type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            # As grpc binds: connections of a worker that just exited (TIME_WAIT) do not hold
            # the port, a listening socket does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise OSError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from exc


def aio_channel(address: str, tls: ClientTLS | None,
                options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.channel_options()])


def sync_channel(address: str, tls: ClientTLS | None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.channel_options()])


@dataclass
class WorkerServerOptions(SchedSliceOption):
    """The flags both gRPC workers share (TLS / mTLS, the SIGTERM drain, the serving threads' time
    slice); each worker's Config inherits them, so the flags and their checks are written once."""

    tls_cert_file: str = field(default="", metadata={"help": "PEM certificate chain; with --tls-key-file serves gRPC over TLS"})
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of --tls-cert-file"})
    tls_client_ca_file: str = field(default="", metadata={
        "help": "PEM CA bundle; set: clients must present a certificate it signed (mTLS)"})
    drain_grace_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM: seconds running requests get to finish before the worker exits"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.drain_grace_s >= 0:
            raise ValueError(f"--drain-grace-s must be >= 0, not {self.drain_grace_s}")
        self.tls = server_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
