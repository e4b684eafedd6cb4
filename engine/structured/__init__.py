"""Structured output: constraints compiled into grammars (grammars.py), each constrained
sequence's matcher (request_grammar.py) and a step's token bitmask (grammar_mask.py). A JSON
schema is first checked and rewritten (schema_rules.py, with pattern_grammar.py: stdlib only,
the service runs them at admission too), then made a grammar (json_schema_grammar.py).

xgrammar does the matching; it is imported on first use, on the compile thread. Imports
`scheduling` (the requests) and nothing else of the engine; `execution` and the engine import it.
"""
