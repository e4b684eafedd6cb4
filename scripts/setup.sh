#!/usr/bin/env bash
# Creates .venv (once) and installs Sluice into it. `scripts/setup.sh dev` adds the test tools.
# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# The client package (./clients/python, `sluice-client`) first: the server depends on it.
if [ "$extras" = "dev" ]; then
  .venv/bin/pip install --quiet -e ./clients/python -e ".[dev]"
else
  .venv/bin/pip install --quiet -e ./clients/python -e .
fi
