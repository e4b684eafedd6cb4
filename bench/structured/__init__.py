"""What structured output costs: a constrained batch beside a free one (`batch`), the
constraint libraries side by side (`libraries`), and a grammar bomb's cost to other callers
(`grammar_compile`).

May import: bench (top-level helpers), engine, sluice_client, tests.support.
"""
