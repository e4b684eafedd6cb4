#!/usr/bin/env bash
# Downloads into .whl/ the wheels a GPU machine without network needs besides its own Python
# 3.12, torch, triton, transformers, tokenizers, safetensors and numpy: the service's other
# dependencies, xgrammar (structured output), and pytest for the GPU tests. bench/run_gpu.sh installs them into /tmp/site
# when .whl/ is there. Run once per checkout, on a machine with PyPI access; .whl/ is kept out
# of git (.git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF /.whl/ .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl)
python3 -m pip download -q --no-deps "${target[@]}" structlog==26.1.0 grpcio==1.85.3 \
  grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1 protobuf==7.36.2 \
  googleapis-common-protos prometheus-client==0.26.0
# structured output: xgrammar and what it needs beyond torch, triton and transformers
python3 -m pip download -q --no-deps "${target[@]}" xgrammar==0.2.8 apache-tvm-ffi pydantic \
  pydantic-core annotated-types typing-inspection typing-extensions
# pytest with its own dependencies (pluggy, iniconfig, packaging, pygments)
python3 -m pip download -q "${target[@]}" pytest pytest-asyncio pytest-timeout
ls .whl
