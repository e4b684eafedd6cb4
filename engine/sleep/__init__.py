"""Sleep and wake: freeing the engine's memory while it serves nothing, and getting it back.

`model_memory` (releasing and reallocating the KV pool's and the weights' storage, and handing
the freed memory back to the system) and `sleeper` (the sleep state machine of one engine:
levels, in-flight policies, wake). May import `execution`, `kv_cache`, `layers`, `models`,
`moe`, `scheduling`, `weights` and `engine.protocol.messages`.
"""
