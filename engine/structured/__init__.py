"""Structured output: constraints compiled into grammars (grammars.py), each constrained
sequence's matcher (request_grammar.py) and a step's token bitmask (grammar_mask.py).

xgrammar does the matching; it is imported on first use, on the compile thread. Imports
`scheduling` (the requests) and nothing else of the engine; `execution` and the engine import it.
"""
