"""The Makefile's installs (README, Quick start), run against a stand-in venv whose python logs its
calls: what each `make serve` / `make test` installs, and that a TORCH_SPEC given once stays."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
case "$*" in *invalid-index*) exit 1;; esac
"""
CUDA = "torch==2.13.0 --index-url https://example.invalid/cu128"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPOSITORY / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def make(checkout: Path, *args: str, ok: bool = True) -> list[str]:
    """The stand-in python's calls during one make run (which fails unless ok)."""
    log = checkout / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    done = subprocess.run(["make", "-s", *args], cwd=checkout, capture_output=True, timeout=60)
    assert (done.returncode == 0) == ok, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def torch_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install --quiet torch") or "uninstall" in c]


def test_a_torch_spec_given_once_stays_until_another_is_given(checkout: Path) -> None:
    first = make(checkout, "serve")
    assert torch_installs(first) == ["-m pip install --quiet torch==2.13.0"]
    assert first[-1] == "-m tokenwire.stack --host 127.0.0.1 --port 8000"
    assert torch_installs(make(checkout, "serve")) == []  # installed: nothing again
    assert torch_installs(make(checkout, "serve", f"TORCH_SPEC={CUDA}")) == [
        "-m pip uninstall --quiet -y torch", f"-m pip install --quiet {CUDA}"]
    # A later call without the variable keeps the CUDA build (it reinstalled the CPU pin before).
    for target in ("test", "serve"):
        calls = make(checkout, target)
        assert not any("pip" in c for c in calls), calls
    assert (checkout / ".venv" / ".torch-spec").read_text().strip() == CUDA
    assert torch_installs(make(checkout, "serve", "TORCH_SPEC=torch==2.13.0")) == [
        "-m pip uninstall --quiet -y torch", "-m pip install --quiet torch==2.13.0"]


def test_a_given_spec_survives_a_reinstall_of_the_project(checkout: Path) -> None:
    """pyproject.toml or the Makefile changed (a git pull): the plain call that reinstalls the project
    kept the CUDA spec but dropped its given-stamp, and the next plain call put the CPU pin back
    (review 107)."""
    make(checkout, "serve", f"TORCH_SPEC={CUDA}")
    (checkout / "pyproject.toml").write_text((checkout / "pyproject.toml").read_text() + "\n")
    assert torch_installs(make(checkout, "serve")) == [f"-m pip install --quiet {CUDA}"]
    assert torch_installs(make(checkout, "serve")) == []


def test_a_spec_given_again_as_the_venv_has_it_is_kept_from_then_on(checkout: Path) -> None:
    """A venv installed before the given-stamp existed: naming its spec again marks it given."""
    make(checkout, "serve", f"TORCH_SPEC={CUDA}")
    (checkout / ".venv" / ".torch-spec-given").unlink()
    assert torch_installs(make(checkout, "serve", f"TORCH_SPEC={CUDA}")) == []
    assert torch_installs(make(checkout, "serve")) == []


def test_a_venv_on_the_pin_follows_it_when_it_moves(checkout: Path) -> None:
    make(checkout, "serve")
    makefile = checkout / "Makefile"
    makefile.write_text(makefile.read_text().replace("DEFAULT_TORCH_SPEC := torch==2.13.0",
                                                     "DEFAULT_TORCH_SPEC := torch==2.14.0"))
    assert torch_installs(make(checkout, "serve")) == [
        "-m pip uninstall --quiet -y torch", "-m pip install --quiet torch==2.14.0"]


def test_a_spec_that_failed_to_install_is_not_kept(checkout: Path) -> None:
    make(checkout, "serve")
    bad = "torch==2.13.0 --index-url https://invalid-index.example/cu128"
    assert torch_installs(make(checkout, "serve", f"TORCH_SPEC={bad}", ok=False)) == [
        "-m pip uninstall --quiet -y torch", f"-m pip install --quiet {bad}"]
    # The next plain call goes back to the pin (it retried the mistyped index for good before: review 105).
    assert torch_installs(make(checkout, "test")) == ["-m pip install --quiet torch==2.13.0"]
    assert torch_installs(make(checkout, "serve")) == []


def test_a_dry_run_shows_an_install_only_where_one_would_run(checkout: Path) -> None:
    make(checkout, "serve")
    dry = subprocess.run(["make", "-n", "serve"], cwd=checkout, check=True, capture_output=True, text=True).stdout
    assert "pip" not in dry and "tokenwire.stack" in dry
    dry = subprocess.run(["make", "-n", "serve", f"TORCH_SPEC={CUDA}"], cwd=checkout, check=True,
                         capture_output=True, text=True).stdout
    assert f"pip install --quiet {CUDA}" in dry
