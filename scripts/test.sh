#!/usr/bin/env bash
# The README's test command: set up .venv with the dev tools, check lint and the generated
# stubs, then run the whole test suite and the type check side by side. Extra arguments go to
# pytest. At the end it prints why each skipped test skipped (pytest -rs), mypy's report, and
# how long the whole run took; it fails if pytest or mypy failed.
#
# pytest runs on every core (pytest-xdist, `-n auto`): one process keeps about one core busy
# (the suite is ~13 min of CPU time), so two workers use both cores of a two-core machine.
# `--dist loadfile` keeps a test file on one worker, so its module-scoped servers and engines
# start once. `-n 0` as an extra argument runs the tests in one process, in order (the last -n
# given wins).
#
# mypy runs beside pytest, its report printed after pytest's: on a fresh clone it has no cache
# and takes about 35 s of one core, which pytest's workers leave idle for minutes in all while
# they wait on servers, engines and timeouts. ruff and the stubs, seconds, still come first.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
trap 'echo "== scripts/test.sh: $((SECONDS - started)) s in all"' EXIT
bash scripts/setup.sh dev
echo "== ruff" && .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== stubs" && bash scripts/gen_protos.sh && git diff --exit-code -- clients/python/sluice/ service/vllm_worker/pb/
mypy_log="$(mktemp)"
trap 'rm -f "$mypy_log"; echo "== scripts/test.sh: $((SECONDS - started)) s in all"' EXIT
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# Idle OpenMP threads sleep instead of spinning (torch's libgomp spins by default): with two
# workers and their engine processes on two cores, a spinning pool burns the core another
# process needs. Ten test files on two workers at a load average of 4: 33 s (44 s of CPU)
# instead of 73 s (83 s of CPU); on a quiet machine the same wall time and 22% less CPU.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
echo "== pytest"
pytest_status=0
.venv/bin/python -m pytest -q -rs -n auto --dist loadfile "$@" || pytest_status=$?
echo "== mypy (ran beside pytest)"
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
[ "$pytest_status" -ne 0 ] && exit "$pytest_status"
exit "$mypy_status"
