"""Sleep and wake: freeing the engine's memory while it serves nothing, and getting it back.

`model_memory` (releasing and reallocating the KV pool's and the weights' storage, and handing
the freed memory back to the system), `draft_memory` (the speculative draft model's, reloaded
from its checkpoint on a Wake) and `sleeper` (the sleep state machine of one engine:
levels, in-flight policies, wake). They reach into the KV pool and prefix cache, the model's weights (and the
prepacked CPU linears rebuilt on wake), the runner's buffers and a weight update in flight.
May import: engine.execution, engine.models, engine.moe, engine.layers, engine.kv_cache, engine.weights, engine.protocol
"""
