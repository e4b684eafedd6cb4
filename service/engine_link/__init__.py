"""The service's link to the engine process: start it, talk to it, keep it serving.

`engine_client` (the one handle the rest of the service uses; `engine_state` its states,
`update_route` its weight updates in flight, `answers` its InitWeightTransfer joins and
CheckConstraint checks),
`engine_process` (one incarnation and its pipe),
`supervisor` (replaces a lost engine; `liveness` judges an idle engine's silence), `routing` (outputs to each request's inbox, metered by
`buffer_meter`), `replay_log` (updates a restarted engine re-applies) and `replay` (doing
it), `tensor_file`, `adapter_link` (LoRA loads and their replay), `adapter_spool` (a streamed
adapter as a PEFT directory, its config checked by the engine's stdlib check) and
`checkpoint_fingerprint`. No protobuf, no grpc.
May import: engine.protocol, engine.process, engine.lora.adapter_config, service.config, service.ops.metrics
"""
