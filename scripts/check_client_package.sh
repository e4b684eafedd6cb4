#!/usr/bin/env bash
# CI: the Python client package on its own. A fresh venv gets only ./clients/python; torch,
# numpy and safetensors must not be importable there, and its `sluice` command and a Python
# snippet must work against a live server (tests/support/serve_tiny.py, run by the repository's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet ./clients/python
client="$work/venv/bin"
"$client/python" - <<'PY'
import importlib.util, sys
present = [m for m in ("torch", "numpy", "safetensors") if importlib.util.find_spec(m)]
sys.exit(f"a client-only install has {present}" if present else 0)
PY
# `sluice serve` without the server: exit 1, saying what to install (not argparse's choices).
if served="$("$client/sluice" serve --model m 2>&1)" || ! grep -q "pip install" <<<"$served"; then
  echo "check_client_package: sluice serve in a client-only install said: $served" >&2
  exit 1
fi

coproc SERVER { .venv/bin/python tests/support/serve_tiny.py; }
read -r ready <&"${SERVER[0]}"
field() { python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$ready" "$1"; }
target="$(field target)"
field apiToken >"$work/token"

"$client/sluice" health --target "$target"
"$client/sluice" generate --target "$target" --api-token-file "$work/token" --max-tokens 8 \
  --temperature 0 --ignore-eos "hello"
"$client/sluice" tokenize --target "$target" --api-token-file "$work/token" "hello world"
SLUICE_TARGET="$target" SLUICE_TOKEN="$(cat "$work/token")" "$client/python" - <<'PY'
import os
from sluice_client import Client

with Client(os.environ["SLUICE_TARGET"], api_token=os.environ["SLUICE_TOKEN"]) as client:
    completion = client.complete("hello", max_tokens=8, temperature=0.0, ignore_eos=True)
assert completion.reason == "LENGTH" and len(completion.token_ids) == 8, completion
print("python client:", completion.token_ids)
PY
exec {SERVER[1]}>&-  # serve_tiny.py stops its server when its stdin closes
wait "$SERVER_PID"
echo "client package OK (no torch, numpy or safetensors)"
