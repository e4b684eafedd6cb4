"""The service's text path per token: incremental detokenization (`detokenize`) and stop-string
matching (`stop_strings`).

May import: bench (top-level helpers), service.
"""
