"""The vLLM worker protocol (`vllm.grpc.engine.VllmEngine`): what the SMG gateway speaks to its
workers, served beside sluice.v1 on the same port, over the same admission path.

servicer.py is VllmEngineServicer; request_mapping.py and responses.py translate a Generate
to and from sluice.v1; info.py answers GetModelInfo, GetServerInfo and GetLoads;
tokenizer_bundle.py builds GetTokenizer's zip; cache_calls.py holds the prefix-cache calls.
`pb/` holds its generated stubs.
May import: service.rpc, service.text, service.engine_link, service.ops, service.config, engine.protocol, sluice.v1
"""
