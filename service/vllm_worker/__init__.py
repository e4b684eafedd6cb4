"""The vLLM worker protocol (`vllm.grpc.engine.VllmEngine`): what the SMG gateway speaks to its
workers, served beside sluice.v1 on the same port, over the same admission path.

`pb/` holds its generated stubs.
May import: service.rpc, service.text, service.engine_link, service.ops, service.config, engine.protocol, sluice.v1
"""
