#!/usr/bin/env bash
# The benchmark smoke CI runs: every benchmark, tiny sizes: 136-202 s measured on 2 cores at a
# load average of 5-11 (other processes busy; 2026-12-05), most of it interpreter and torch
# start-up.
# Exits non-zero if any benchmark fails or prints no JSON.
exec bash "$(dirname "$0")/run_cpu.sh" --smoke "$@"
