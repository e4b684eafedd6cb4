#!/usr/bin/env bash
# The README's first command: serve the built-in demo model and stream a completion from it.
# From a fresh clone: creates .venv, installs a CPU torch first (an unpinned torch would pull a
# multi-GB CUDA build), installs Sluice, starts `sluice serve --model demo --port 0`, waits for
# health SERVING (the demo model is trained on first use: two to three minutes, once), streams text, stops.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT="${1:-Call me Ishmael. Some years ago}"

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks the CPU wheel where PyPI's default
# would be the CUDA one.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
.venv/bin/pip install --quiet -e .

LOG="$(mktemp -t sluice-demo.XXXXXX.log)"
.venv/bin/sluice serve --model demo --port 0 --device auto 2>"$LOG" &
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
echo "sluice is listening on 127.0.0.1:$PORT; loading the demo model (first run trains it)..." >&2

# Show the demo model's one-time build progress while waiting.
tail -n +1 -f "$LOG" | grep --line-buffered "engine.demo" >&2 &
PROGRESS=$!
if ! .venv/bin/sluice health --target "127.0.0.1:$PORT" --wait 900 >/dev/null; then
  kill "$PROGRESS" 2>/dev/null
  echo "the server did not become SERVING; log: $LOG" >&2
  exit 1
fi
kill "$PROGRESS" 2>/dev/null
.venv/bin/sluice generate --target "127.0.0.1:$PORT" --max-tokens 80 --temperature 0.8 \
  --seed 0 "$PROMPT"
