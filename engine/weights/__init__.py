"""Weights: loading a checkpoint at start, and swapping new weights in while serving.

`loading` (safetensors checkpoints into the model by name), `checks` (what an update's source
can be refused for before anything pauses), `staging` (read and validate, then swap),
`sharded_update` (the same over every tensor-parallel rank), `transfer_group` (a trainer's
process group, for distributed updates; `group_join` joins it beside the engine loop),
`buckets` (their layout), `distributed` (staging
them) and `weight_updater` (the update state machine of one engine: it drains the scheduler
and clears the prefix cache).
May import: engine.models, engine.parallel, engine.scheduling, engine.kv_cache, engine.protocol.messages
"""
