#!/usr/bin/env bash
# Creates .venv (once) and installs Sluice into it. `scripts/setup.sh dev` adds the test tools.
# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
#
# A run that finds .venv already set up calls no pip at all, so it works offline:
# .venv/.sluice-setup records a hash of both pyproject.toml files and which extras were
# installed. Sluice and the client are editable installs, so a change to their source needs no
# reinstall; a change to their dependencies (a pyproject.toml) does, and gets one.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
TORCH_VERSION=2.13.0
STAMP=.venv/.sluice-setup
key="$(cat pyproject.toml clients/python/pyproject.toml | sha256sum | cut -d' ' -f1)"

set_up() {  # the stamp covers these extras, and .venv imports this checkout's packages
  [ -f "$STAMP" ] || return 1
  if [ "$extras" = "dev" ]; then
    grep -qx "$key dev" "$STAMP" || return 1
  else
    grep -qx -e "$key dev" -e "$key base" "$STAMP" || return 1
  fi
  # -I: neither the current directory nor PYTHONPATH may stand in for the installed packages.
  .venv/bin/python -I -c '
import sys
from pathlib import Path
import service, sluice_client, torch  # noqa: F401
root = Path(sys.argv[1]).resolve()
here = [Path(m.__file__).resolve() for m in (service, sluice_client)]
sys.exit(0 if all(root in p.parents for p in here) else 1)
' "$PWD" 2>/dev/null
}

if set_up; then
  exit 0
fi
what="Sluice"
[ "$extras" = "dev" ] && what="Sluice and its test tools"
echo "Installing torch $TORCH_VERSION${TORCH_INDEX_URL:+ (from $TORCH_INDEX_URL)} and $what" \
  "into .venv (a few minutes, once)..." >&2
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# The client package (./clients/python, `sluice-client`) first: the server depends on it.
if [ "$extras" = "dev" ]; then
  .venv/bin/pip install --quiet -e ./clients/python -e ".[dev]"
else
  .venv/bin/pip install --quiet -e ./clients/python -e .
fi
echo "$key ${extras:-base}" >"$STAMP"
