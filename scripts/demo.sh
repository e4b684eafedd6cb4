#!/usr/bin/env bash
# The README's first command: serve the built-in demo model and stream a completion from it.
# From a fresh clone: sets up .venv as scripts/setup.sh does (a CPU torch first, then the client
# package, then Sluice; a later run finds it set up and calls no pip, so it works offline),
# builds the demo model if it is not cached (about a minute on two idle cores, once), starts
# `sluice serve --model demo --port 0`, waits for health SERVING, streams text, stops.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT="${1:-Call me Ishmael. Some years ago}"

# One install path for every entry point: setup.sh knows the order (torch, the client, Sluice).
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks the CPU wheel where PyPI's default
# would be the CUDA one.
bash scripts/setup.sh

# The one-time build, in the foreground: its progress in plain lines (the server would log it
# as records); the server then loads the cached checkpoint.
.venv/bin/python -m engine.demo >/dev/null

LOG="$(mktemp -t sluice-demo.XXXXXX.log)"
echo "Starting the server (its log: $LOG)..." >&2
.venv/bin/sluice serve --model demo --port 0 --device auto --log-format json 2>"$LOG" &
SERVER=$!
trap 'kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT

# --port 0: the server logs the port it bound ("server.listening").
PORT=""
for _ in $(seq 1 100); do
  PORT="$(grep -m1 '"server.listening"' "$LOG" | sed -E 's/.*"port": ([0-9]+).*/\1/' || true)"
  [ -n "$PORT" ] && break
  if ! kill -0 "$SERVER" 2>/dev/null; then cat "$LOG" >&2; exit 1; fi
  sleep 0.2
done
[ -n "$PORT" ] || { echo "the server did not report its port; log: $LOG" >&2; exit 1; }
echo "sluice is listening on 127.0.0.1:$PORT; loading the demo model..." >&2
if ! .venv/bin/sluice health --target "127.0.0.1:$PORT" --wait 900 >/dev/null; then
  echo "the server did not become SERVING; log: $LOG" >&2
  exit 1
fi
.venv/bin/sluice generate --target "127.0.0.1:$PORT" --max-tokens 80 --temperature 0.8 \
  --seed 0 "$PROMPT"
