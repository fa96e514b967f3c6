"""Generates the Python wire code in tokenwire/v1 from the .proto files in proto/.

Run by `make proto` and by the staleness test, which generates into a scratch folder and
compares, so checked-out code can never drift from the contract.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("tokenwire/v1/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir/tokenwire/v1."""
    from grpc_tools import protoc  # imported here: only the build step needs grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "tokenwire" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write tokenwire/v1 under")
    written = generate(parser.parse_args().out)
    print(f"generated {len(written)} files from {len(proto_files())} protos", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
