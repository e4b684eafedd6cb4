#!/usr/bin/env bash
# CI's run of the README's first command as a new user meets it: `bash scripts/demo.sh` under a
# fresh HOME (no pip cache, no demo model built before), then a check that the server streamed
# text back after the prompt. Run it from a clean checkout so that .venv is made from nothing too.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT="Call me Ishmael. Some years ago"  # demo.sh's own default, the one a new user sees
fresh_home="$(mktemp -d -t sluice-home.XXXXXX)"
trap 'rm -rf "$fresh_home"' EXIT
out="$(HOME="$fresh_home" bash scripts/demo.sh "$PROMPT")"
printf '%s\n' "$out"
completion="${out#*"$PROMPT"}"
if [ -z "${completion//[[:space:]]/}" ]; then
  echo "check_demo: scripts/demo.sh streamed no text back" >&2
  exit 1
fi
[ -n "$(ls -A "$fresh_home/.cache/sluice" 2>/dev/null)" ] || {
  echo "check_demo: the demo model was not built under the fresh HOME" >&2
  exit 1
}
