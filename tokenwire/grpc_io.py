"""Which of grpc-core's two socket layers the tokenwire processes run on: the poll-based one.

Python's grpcio runs its sockets on grpc-core's EventEngine (the experiments `event_engine_client`
and `event_engine_listener`, on by default in the grpcio releases tokenwire takes) or on the older
poll-based layer (iomgr) with both turned off. The older layer costs a Python process about half
the CPU per stream message on loopback, and every token of the serving path crosses three such
messages (model worker -> gateway -> detok worker -> gateway). Measured on the 2-core host:
- one bidi stream between two processes, a 200-byte write then a read of its echo (scratch,
  3000 each, 2026-11-24): 80-89 us a round trip and 56-58 us of the client's CPU with both off,
  against 150-197 us and 99-118 us on EventEngine (grpcio 1.85.3; 1.78.0: 100 against 170 us);
- TTFT the gateway and detok worker add (`bench.ttft_added --requests 100`, 12 rounds each way,
  alternating): mean 4.53 ms (paired 4.21) against 5.32 (paired 4.76); throughput did not move
  beyond noise (README, Performance, "gRPC's socket layer").
Apache Beam turns `event_engine_client` off for its loopback streams too (ping timeouts, grpc
issue 39113).

grpc-core reads GRPC_EXPERIMENTS once, when grpc is imported, so use_poll_io runs from tokenwire's
own __init__, and each service package (and bench, and the tests' conftest, and the two benchmark
scripts run as files) imports tokenwire before anything there imports grpc.
A GRPC_EXPERIMENTS already in the environment wins, an empty one included (grpc's defaults).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

EXPERIMENTS_VARIABLE = "GRPC_EXPERIMENTS"
POLL_IO_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
# grpcio minor releases (1.x) whose core knows both experiment names, checked on 1.66.2, 1.78.0,
# 1.80.0 and 1.85.3. grpc plans to remove them; a core that does not know a name logs an error at
# start, so later releases keep their default until checked.
CHECKED_MINOR_RELEASES = range(66, 86)


def grpcio_version() -> str:
    """The installed grpcio's version, read without importing grpc (importlib.metadata itself
    takes ~20 ms to import, so only where the choice needs it)."""
    from importlib import metadata

    try:
        return metadata.version("grpcio")
    except metadata.PackageNotFoundError:
        return ""


def knows_poll_io_experiments(version: str) -> bool:
    major, _, rest = version.partition(".")
    minor = rest.partition(".")[0]
    return major == "1" and minor.isdigit() and int(minor) in CHECKED_MINOR_RELEASES


def choose_io(environ: Mapping[str, str], version: str | Callable[[], str],
              grpc_imported: bool) -> tuple[str | None, str]:
    """(the GRPC_EXPERIMENTS value to set, or None to leave it; which layer gRPC runs on, for the log).
    version: grpcio's, or what reads it, called only where the environment has not decided."""
    if EXPERIMENTS_VARIABLE in environ:
        return None, f"gRPC I/O: {EXPERIMENTS_VARIABLE}={environ[EXPERIMENTS_VARIABLE]!r} from the environment"
    if grpc_imported:
        # Too late for this process: the processes it starts would take it and differ from it.
        return None, "gRPC I/O: grpc's default (grpc was imported before tokenwire could choose)"
    if callable(version):
        version = version()
    if not knows_poll_io_experiments(version):
        return None, f"gRPC I/O: grpc's default (grpcio {version or 'missing'}: a release not checked for {POLL_IO_EXPERIMENTS})"
    return POLL_IO_EXPERIMENTS, f"gRPC I/O: poll-based ({EXPERIMENTS_VARIABLE}={POLL_IO_EXPERIMENTS})"


_note = ""


def use_poll_io() -> None:
    """Turns the EventEngine experiments off for this process (and the ones it starts) where that
    takes effect. tokenwire's __init__ calls it, once per process."""
    global _note
    value, _note = choose_io(os.environ, grpcio_version, "grpc" in sys.modules)
    if value is not None:
        os.environ[EXPERIMENTS_VARIABLE] = value


def io_note() -> str:
    """What use_poll_io found."""
    return _note


def log_io_note() -> None:
    """For each service's start-up log, once logging is set up."""
    logger.info(_note)
