"""Structured output: constraints compiled into grammars (grammars.py) by worker processes
(compile_pool.py, compile_queue.py, compile_worker.py: bounded, killable, fair between
callers), each constrained sequence's matcher (request_grammar.py) and a step's token bitmask
(grammar_mask.py). A JSON schema is first checked and rewritten
(engine/protocol/validation/schema_rules.py, with pattern_grammar.py there: stdlib only, the
service runs them at admission too), then made a grammar (json_schema_grammar.py), in the
worker.

xgrammar does the matching; it is imported on first use, on a compile thread and in the
workers. Nothing else of the engine: scheduling, sampling and the engine import it.
May import: engine.protocol, engine.parent_death
"""
