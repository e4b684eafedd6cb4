#!/usr/bin/env bash
# The Node.js client's checks (run by .ci/run): install the pinned dependencies, type-check
# index.d.ts against test/types_check.ts, then run the tests. The live-server tests start
# tests/support/serve_tiny.py with $SLUICE_PYTHON (default: the repository's .venv, made by
# scripts/setup.sh), which needs torch and transformers to write a tiny checkpoint.
set -euo pipefail
cd "$(dirname "$0")"
export SLUICE_PYTHON="${SLUICE_PYTHON:-$PWD/../../.venv/bin/python}"
npm ci --no-audit --no-fund --loglevel=error
npm test --silent
