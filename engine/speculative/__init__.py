"""Speculative decoding: proposers guess a request's next tokens; one forward pass verifies them.

`proposer` (the interface), `ngram` (prompt lookup in the request's own tokens), `suffix`
(its tokens and a store of finished outputs: `continuations`, `suffix_store`), `draft` (the
draft-model proposer: `draft_model` loads the draft and sizes its KV pool, `draft_vocab`
checks its vocabulary against the target's, `draft_seq` is what it keeps per request,
`draft_pass` one batched forward of it, and its followers on the other tensor-parallel
ranks) and `factory` (the configured proposer); `verify`
(SpecDecoder) gives requests their drafts before a step and keeps what the step's sampling
reproduces.
May import: engine.attention, engine.execution, engine.kv_cache, engine.layers, engine.models, engine.parallel, engine.protocol, engine.scheduling, engine.structured, engine.weights
"""
