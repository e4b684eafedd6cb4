"""Operations: what the server needs from and shows to its host.

`metrics` and `metrics_http` (Prometheus), `tls` (credentials checked at start), `connections`
(the bound on held connections), `priority` (the service yields the CPU to the engine) and
`grpc_core_log` (gRPC core's stderr caught as a field). Nothing from `rpc`, `engine_link` or
`text`: they all use it.
May import: service.config, engine.protocol.messages
"""
