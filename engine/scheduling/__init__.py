"""Scheduling: which requests advance each step, and the KV pages they hold.

`request` (a request's state), `scheduler` (continuous batching under a token budget, over the
KV cache's pages: engine/kv_cache/) and `prompt_scores` (a request's prompt logprobs, collected
as its prompt is computed). No model, no sampler.
May import: engine.kv_cache, engine.protocol.messages, engine.structured.request_grammar
"""
