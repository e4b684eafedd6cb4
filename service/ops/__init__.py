"""Operations: what the server needs from and shows to its host.

`metrics` and `metrics_http` (Prometheus), `tls` (credentials checked at start), `connections`
(the bound on held connections), `priority` (the service yields the CPU to the engine) and
`grpc_core_log` (gRPC core's stderr caught as a field). May import `service.config` and
`engine.protocol.messages`; nothing from `rpc`, `engine_link` or `text`.
"""
