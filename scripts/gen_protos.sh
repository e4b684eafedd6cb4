#!/usr/bin/env bash
# Regenerates the committed Python stubs of proto/sluice/v1/*.proto (messages, grpc services, and
# mypy-protobuf .pyi type stubs) with the pinned grpcio-tools and mypy-protobuf of the venv.
# They live in the client package (clients/python/sluice/v1), which the server also imports.
# Deterministic: CI runs it and fails when `git diff --exit-code clients/python/sluice/` shows a
# change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
BIN_DIR="$(dirname "$PYTHON")"
# The stubs import each other as `sluice.v1.xxx_pb2`: the include root is proto/, and the output
# root is clients/python.
"$PYTHON" -m grpc_tools.protoc \
  -I proto \
  --plugin=protoc-gen-mypy="$BIN_DIR/protoc-gen-mypy" \
  --plugin=protoc-gen-mypy_grpc="$BIN_DIR/protoc-gen-mypy_grpc" \
  --python_out=clients/python \
  --grpc_python_out=clients/python \
  --mypy_out=clients/python \
  --mypy_grpc_out=clients/python \
  $(cd proto && ls sluice/v1/*.proto | LC_ALL=C sort)

# The vLLM worker protocol (vllm.grpc.engine.VllmEngine, which the SMG gateway speaks), from the
# proto files of the pinned smg-grpc-proto release copied unchanged into third_party/ (a test
# checks they equal the installed package's). Its stubs are the service's alone:
# service/vllm_worker/pb/. The protos import each other by bare file name ("common.proto"), so
# protoc writes `import common_pb2`; rewritten to a relative import to stay inside the package.
OUT=service/vllm_worker/pb
"$PYTHON" -m grpc_tools.protoc \
  -I third_party/smg_grpc_proto \
  --plugin=protoc-gen-mypy="$BIN_DIR/protoc-gen-mypy" \
  --plugin=protoc-gen-mypy_grpc="$BIN_DIR/protoc-gen-mypy_grpc" \
  --python_out="$OUT" \
  --grpc_python_out="$OUT" \
  --mypy_out="$OUT" \
  --mypy_grpc_out="$OUT" \
  common.proto vllm_engine.proto
sed -i -E 's/^import (common_pb2|vllm_engine_pb2) as /from . import \1 as /' "$OUT"/*_pb2*.py "$OUT"/*_pb2*.pyi
