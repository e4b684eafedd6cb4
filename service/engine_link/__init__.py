"""The service's link to the engine process: start it, talk to it, keep it serving.

`engine_client` (the one handle the rest of the service uses; `engine_state` its states,
`update_route` its weight updates in flight, `engine_calls` its transfer joins, constraint
checks and stats requests), `awaiting_answers` (the one registry of messages waiting for the
engine's answer, failed UNAVAILABLE when the engine is lost: updates, joins, checks, sleep and
wake, adapter calls), `engine_process` (one incarnation and its pipe), `supervisor` (replaces
a lost engine; `liveness` judges an idle engine's silence), `routing` (outputs to each
request's inbox, metered by `buffer_meter`), `replay_log` (updates a restarted engine
re-applies) and `replay` (doing it), `tensor_file`, `sleep_link` (sleep and wake),
`adapter_link` (LoRA loads and their replay), `adapter_files` (their configs' checks),
`adapter_spool` (a streamed adapter as a PEFT directory) and `checkpoint_fingerprint`. No
protobuf, no grpc.
May import: engine.protocol, engine.process, service.config, service.ops.metrics
"""
