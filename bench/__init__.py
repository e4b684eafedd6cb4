"""Sluice benchmarks: offline throughput, decode step time, serving latency, prefix cache.

Run them from the repository root as modules (`python -m bench.offline ...`); each prints one
JSON object on stdout and a short table on stderr. `bench/run_cpu.sh`, `bench/run_gpu.sh` and
`bench/smoke.sh` run the suites; docs/benchmarks.md holds the numbers.
"""
