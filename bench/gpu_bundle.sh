#!/usr/bin/env bash
# Fills .gpu/ (git-ignored) with what bench/gpu_session.sh needs on a GPU machine that has torch,
# triton, transformers and grpcio but no network: wheels of the other Python packages, at this
# venv's versions (CPython 3.12, manylinux x86-64), the generated gRPC modules, SmolLM2's config and
# tokenizer, and the Llama-3-8B shape dir. Run from the repository root after `make proto`.
set -euo pipefail
PY=${PY:-.venv/bin/python}
TARGET_PYTHON=${TARGET_PYTHON:-3.12}
# What one such image (the H100 machines lent here, 2026-11) lacked, or had at versions older than
# the generated code or fastapi need.
PACKAGES="grpcio protobuf grpcio-health-checking grpcio-reflection gguf llguidance fastapi starlette pydantic
pydantic_core typing-inspection annotated-types annotated-doc uvicorn pytest-asyncio typing_extensions opentelemetry-api"
mkdir -p .gpu/whl .gpu/pb2 .gpu/smollm2
for name in $PACKAGES; do
  version=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  spec=$name${version:+==$version}
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/whl "$spec"
done
cp tokenwire/v1/*_pb2*.py .gpu/pb2/
model_dir=$($PY -c "from pathlib import Path; from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir; \
print(resolve_model_dir(DEFAULT_MODEL, Path.home() / '.cache' / 'tokenwire'))")
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$model_dir/$f" ] && cp "$model_dir/$f" .gpu/smollm2/
done
$PY -m bench.model_shapes llama3-8b .gpu/llama3-8b --tokenizer-from .gpu/smollm2
du -sh .gpu
