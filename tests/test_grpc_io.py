"""tokenwire/grpc_io.py: the services' gRPC runs on grpc-core's poll-based socket layer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenwire.grpc_io import (
    EXPERIMENTS_VARIABLE,
    POLL_IO_EXPERIMENTS,
    choose_io,
    grpcio_version,
    knows_poll_io_experiments,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("version", "known"), [
    ("1.66.0", True), ("1.66.2", True), ("1.78.0", True), ("1.85.3", True),
    ("1.65.5", False), ("1.86.0", False), ("1.100.0", False), ("2.0.0", False), ("", False), ("1.x", False),
])
def test_only_checked_grpcio_releases_take_the_poll_based_layer(version: str, known: bool) -> None:
    assert knows_poll_io_experiments(version) is known
    value, note = choose_io({}, version, grpc_imported=False)
    assert value == (POLL_IO_EXPERIMENTS if known else None)
    assert ("poll-based" in note) is known


@pytest.mark.parametrize("given", ["", "-event_engine_client", "event_engine_client"])
def test_a_value_in_the_environment_wins_even_empty(given: str) -> None:
    value, note = choose_io({EXPERIMENTS_VARIABLE: given}, "1.85.3", grpc_imported=False)
    assert value is None
    assert repr(given) in note and "environment" in note


@pytest.mark.parametrize("version", ["1.85.3", "1.86.0"])
def test_nothing_is_set_once_grpc_is_imported(version: str) -> None:
    # grpc-core has read the variable already: setting it would only make this process's
    # children differ from it. Said whatever the release, so the import-order test below holds
    # on any grpcio.
    value, note = choose_io({}, version, grpc_imported=True)
    assert value is None
    assert "imported before" in note


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_VARIABLE}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**environ, **env},
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.parametrize("package", ["gateway", "model_worker", "detok_worker", "tokenwire.stack",
                                     "bench.ttft_added"])
def test_each_entry_point_chooses_before_it_imports_grpc(package: str) -> None:
    """Importing the module as `python -m` does (its packages first) chooses before grpc is imported
    (the note would say so otherwise, on any grpcio), sets the variable where the release is one
    checked, and that grpc-core knows both experiment names: no 'Unknown experiment' at its start."""
    done = _run(f"import {package}, os, grpc\n"
                "grpc.insecure_channel('127.0.0.1:9').close()\n"
                f"print(os.environ.get({EXPERIMENTS_VARIABLE!r}, ''))\n"
                "from tokenwire.grpc_io import io_note\nprint(io_note())")
    expected, expected_note = choose_io({}, grpcio_version(), grpc_imported=False)
    value, note = done.stdout.splitlines()[-2:]
    assert value == (expected or "")
    assert note == expected_note and "imported before" not in note
    assert "Unknown experiment" not in done.stderr


@pytest.mark.parametrize("script", ["bench/soak.py", "bench/bench_detok_grpc.py"])
def test_benchmark_scripts_run_as_files_choose_before_grpc(script: str) -> None:
    """These two are run as files (bench/README.md), where bench/__init__ does not run: the top of
    each imports tokenwire before grpc. Checked by running the file's imports alone."""
    source = (ROOT / script).read_text()
    imports = source[:source.index("\n\n\n", source.index("import grpc"))]  # up to the first definition
    done = _run(imports.replace("Path(__file__)", f"Path({str(ROOT / script)!r})") +
                "\nfrom tokenwire.grpc_io import io_note\nprint(io_note())")
    assert "imported before" not in done.stdout.splitlines()[-1]


def test_a_service_keeps_the_value_it_was_started_with() -> None:
    done = _run(f"import gateway, os\nprint(os.environ[{EXPERIMENTS_VARIABLE!r}])", GRPC_EXPERIMENTS="")
    assert done.stdout.splitlines()[-1:] in ([], [""])
