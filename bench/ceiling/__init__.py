"""The service's ceiling: how many tokens/s one service process streams, and its per-token cost.

`run` drives the real server (`server`, run as a script) in front of an instant stand-in engine
from client processes (`clients`); `grpc_floor` measures grpc.aio's own cost under it and
`service_path` times the per-token path piece by piece.

May import: bench (top-level helpers), engine, service, tests.support.
"""
