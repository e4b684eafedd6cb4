"""Sluice service: the grpc.aio server in front of one engine process. Never imports torch.

Top level: `server` (create_server / serve), `config` and `flags` (ServiceConfig and `sluice
serve`'s flags), `cli`, `__main__`. Below: `rpc/` (servicers, interceptors) -> `text/`
(tokenizer, detokenizer, stop strings) and `engine_link/` (engine client, process, supervisor);
`ops/` (metrics, TLS, connections) is used by all. From the engine only its contract
(`engine.protocol`), `engine.process` (the spawn target) and `engine.logs`; from the client
package the `sluice` command it adds `serve` to.
May import: engine.protocol, engine.process, engine.logs, sluice.v1, sluice_client.cli, sluice_client.verb_flags
"""
