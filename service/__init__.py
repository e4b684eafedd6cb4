"""Sluice service: the grpc.aio server in front of one engine process. Never imports torch.

Top level: `server` (create_server / serve), `config` and `flags` (ServiceConfig and `sluice
serve`'s flags), `cli`, `__main__`. Below: `rpc/` (servicers, interceptors) -> `text/`
(tokenizer, detokenizer, stop strings) and `engine_link/` (engine client, process, supervisor);
`ops/` (metrics, TLS, connections) is used by all. From the engine only `engine.protocol` (the
pipe's messages, the config and its settings, the error codes, and the rules of
`engine/protocol/validation/`), `engine.process` (the spawn target) and `engine.logs`.
"""
