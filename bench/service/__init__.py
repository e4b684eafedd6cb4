"""Serving over gRPC: the load generator (`serve`) against `python -m service` as started and
awaited by `server`, health checks under load (`health_under_load`), the OpenAI front's HTTP
library choice (`http_front`: aiohttp against FastAPI on uvicorn, no model), and the same
streams through sluice.v1, the OpenAI front and the SMG gateway (`gateway`, its paths in
`gateway_paths`).

May import: bench (top-level helpers), bench.throughput (run as a process), engine, service,
sluice_client, tests.support.
"""
