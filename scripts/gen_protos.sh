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
