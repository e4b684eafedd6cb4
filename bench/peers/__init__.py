"""Sluice beside vLLM's CPU build on the same machine, workload and settings: offline
(`offline`, each engine in a `workers` process) and served over each one's API (`serve`, with
`http_stream` as the OpenAI-side client). `vllm_venv` makes vLLM's virtual environment.

May import: bench (top-level helpers), bench.throughput, bench.service, engine, service.
"""
