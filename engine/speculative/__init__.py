"""Speculative decoding: proposers guess a request's next tokens; one forward pass verifies them.

`proposer` (the interface), `ngram` (prompt lookup in the request's own tokens), `suffix`
(its tokens and a store of finished outputs: `continuations`, `suffix_store`) and `factory`
(the configured proposer). Proposers are host-side and model-free.
May import: engine.protocol, engine.scheduling
"""
