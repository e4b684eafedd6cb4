#!/usr/bin/env bash
# The benchmark smoke CI runs: every benchmark, tiny sizes, about a minute on 2 cores.
# Exits non-zero if any benchmark fails or prints no JSON.
exec bash "$(dirname "$0")/run_cpu.sh" --smoke "$@"
