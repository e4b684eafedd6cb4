"""Serving over gRPC: the load generator (`serve`) against `python -m service` as started and
awaited by `server`, and health checks under load (`health_under_load`).

May import: bench (top-level helpers), bench.throughput (run as a process), engine, service,
sluice_client, tests.support.
"""
