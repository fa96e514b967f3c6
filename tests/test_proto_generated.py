"""The generated wire code in tokenwire/v1 matches proto/ exactly (fails when stale)."""

from __future__ import annotations

from pathlib import Path

from tokenwire import protogen

GENERATED_DIR = protogen.REPO_ROOT / "tokenwire" / "v1"


def test_generated_code_is_fresh(tmp_path: Path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        checked_in = GENERATED_DIR / path.name
        assert checked_in.is_file(), f"{checked_in} missing: run `make proto`"
        assert checked_in.read_bytes() == path.read_bytes(), f"{checked_in.name} is stale: run `make proto`"
    stray = {p.name for p in GENERATED_DIR.glob("*_pb2*.py*")} - {p.name for p in fresh}
    assert not stray, f"generated files with no .proto: {stray}"
