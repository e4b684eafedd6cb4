"""The gRPC surface: the Generation and Admin servicers and what runs around every call.

`servicer`, `generate_stream` (bidi multiplexing), `admin` (with `weight_transfer`, its
process-group fields, `adapters` and `adapter_stream` for LoRA loads, `arriving` for client
streams that must keep sending), `admission` (request -> AddRequest
or a refusal with its status code), and the interceptors: `auth`, `call_limit`, `call_metrics`,
`decoding` (`handlers` rewraps a handler for them). Protobuf stops here. Of the engine, besides
its contract: the checks both processes run at admission (an adapter's config, a JSON schema's
rules), which are standard library only.
May import: service.text, service.engine_link, service.ops, service.config, engine.protocol, engine.lora.adapter_config, engine.structured.schema_rules, sluice.v1
"""
