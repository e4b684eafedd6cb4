"""A grammar bomb: a GBNF grammar that xgrammar compiles in time that grows much faster than its
size, uninterruptibly. Each of `rules` rules is a literal or any run of letters, then the next
rule: 4,000 rules (150 kB) take about 35-60 s on the tests' 320-token vocabulary (1,000 rules:
about 2 s), well under the 1 MiB bound on a constraint's document. (A JSON schema of 900 nested
arrays did the same before schemas were bounded at 64 levels.)"""

from __future__ import annotations

BOMB_RULES = 4000


def wide_grammar(rules: int = BOMB_RULES) -> str:
    """The bomb of `rules` rules; another count is another document (not a cached refusal)."""
    body = "".join(f'r{i} ::= "w{i}" r{i + 1} | [a-z]* r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "."\n'


def long_grammar(classes: int = 100_000) -> str:
    """A memory bomb: `classes` character classes in a row (600 kB at 100,000), a state each,
    which xgrammar compiles in about a second into more than 150 MiB."""
    return "root ::= " + " ".join(["[a-z]"] * classes)
