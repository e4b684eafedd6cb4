"""json_schema_grammar: a `json_schema` constraint as an xgrammar Grammar, after schema_rules.

xgrammar converts the checked schema; each string placeholder schema_rules put in a `pattern`
comes out of it as one rule `Regex("sluice_string_N", json_string=true)`, which is replaced by
Sluice's own expression (pattern_grammar.py) before the grammar is parsed again. A placeholder
left in another form (another xgrammar version printing differently) is an error, never a
string constrained wrongly; one in a definition nothing refers to is not in the grammar at all.
"""

from __future__ import annotations

import re
from typing import Any

from engine.protocol.validation.schema_rules import CheckedSchema

_REGEX_RULE = re.compile(r'Regex\("(sluice_string_\d+)"(?:, *json_string=true)?\)')


def json_schema_grammar(
    checked: CheckedSchema, any_whitespace: bool, max_whitespace: int, strict: bool = True
) -> Any:
    """The xgrammar Grammar of the schema: compact JSON (", " and ": " between tokens) unless
    `any_whitespace`, then runs of at most `max_whitespace` whitespace characters."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(
        checked.text,
        any_whitespace=any_whitespace,
        max_whitespace_cnt=max_whitespace if any_whitespace else None,
        strict_mode=strict,
    )
    if not checked.strings:
        return grammar

    def expression(match: re.Match[str]) -> str:
        return "(" + checked.strings[match.group(1)] + ")"

    # A placeholder of a definition nothing refers to is not in the grammar at all.
    text = _REGEX_RULE.sub(expression, str(grammar))
    if 'Regex("sluice_string_' in text:
        raise RuntimeError("xgrammar printed a string rule in a form Sluice cannot replace")
    rules = "".join(f"{name} ::= {body}\n" for name, body in checked.rules.items())
    return xgrammar.Grammar.from_ebnf(text + "\n" + rules)
