"""Speculative decoding: proposers guess a request's next tokens; one forward pass verifies them.

`proposer` (the Proposer interface every method implements), `draft` (the draft-model
proposer: `draft_model` loads the draft and sizes its KV pool, `draft_vocab` checks its
vocabulary against the target's, `draft_seq` is what it keeps per request, `draft_pass` one
batched forward of it).

May import: engine.attention, engine.execution, engine.kv_cache, engine.layers, engine.models, engine.protocol, engine.scheduling, engine.weights
"""
