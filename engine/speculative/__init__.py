"""Speculative decoding: proposers guess a request's next tokens; one forward pass verifies them.

proposer.py is the interface, methods.py makes the configured proposer, verify.py (SpecDecoder)
gives requests their drafts before a step and keeps what the step's sampling reproduces.
May import: engine.attention, engine.execution, engine.kv_cache, engine.layers, engine.models, engine.protocol, engine.scheduling, engine.structured, engine.weights
"""
