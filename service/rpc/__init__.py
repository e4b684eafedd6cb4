"""The gRPC surface: the Generation and Admin servicers and what runs around every call.

`servicer`, `generate_stream` (bidi multiplexing), `admin` (with `weight_transfer`, its
process-group fields, `adapters` and `adapter_stream` for LoRA loads, `arriving` for client
streams that must keep sending), `admission` (request -> AddRequest or a refusal with its
status code, by engine/protocol/validation/'s rules), `refusal` (a refusal as a gRPC status
with its details), `engine_status` (the one map from an engine ErrorCode to a gRPC status),
and the interceptors: `auth`, `call_limit`, `call_metrics`, `decoding` (`handlers` rewraps a
handler for them). Protobuf stops here.
May import: service.text, service.engine_link, service.ops, service.config, engine.protocol, sluice.v1
"""
