#!/usr/bin/env bash
# The benchmark smoke CI runs: every benchmark, tiny sizes: 149 s measured on 2 cores at a load
# average of 9-12 (other processes busy), most of it interpreter and torch start-up.
# Exits non-zero if any benchmark fails or prints no JSON.
exec bash "$(dirname "$0")/run_cpu.sh" --smoke "$@"
