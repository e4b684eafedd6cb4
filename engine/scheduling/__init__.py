"""Scheduling: which requests advance each step, and the KV pages they hold.

`request` (a request's state), `scheduler` (continuous batching under a token budget),
`page_pool` (the paged K/V storage and reference counts), `prefix_cache` (full pages shared
by hash), `block_table` (every request's pages, a row per slot, kept as they change) and
`prompt_scores` (a request's prompt logprobs, collected as its prompt is computed). Imports
only `engine.protocol.messages` and its own modules: no model, no sampler.
"""
