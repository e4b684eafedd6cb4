"""GenerateRequest.structured from keyword arguments: the constraint on a completion's text.

The proto's StructuredOutput is a oneof, so at most one kind may be given; a second one is a
ValueError here rather than the last one silently winning on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.v1 import generation_pb2 as pb


def structured_output(
    *,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
) -> pb.StructuredOutput | None:
    """The StructuredOutput of at most one constraint, None when none is given.
    `json_schema`: a schema as a dict (sent as JSON) or as JSON text (sent as it is);
    `json_object=True`: any JSON object; `regex`: a pattern the whole text matches; `grammar`:
    GBNF text with a `root` rule; `choice`: the strings the text may be (a list, not a str).
    The server checks the documents themselves (INVALID_ARGUMENT naming `structured.<kind>`)."""
    given = [
        name
        for name, value in (
            ("json_schema", json_schema),
            ("json_object", json_object or None),  # false is the same as unset
            ("regex", regex),
            ("grammar", grammar),
            ("choice", choice),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            "at most one of json_schema, json_object, regex, grammar and choice; "
            f"got {', '.join(given)}"
        )
    if isinstance(choice, str):
        raise TypeError("choice: a list of strings, not one string")
    structured = pb.StructuredOutput()
    if isinstance(json_schema, str):
        structured.json_schema = json_schema
    elif json_schema is not None:
        structured.json_schema = json.dumps(dict(json_schema))
    elif json_object:
        structured.json_object = True
    elif regex is not None:
        structured.regex = regex
    elif grammar is not None:
        structured.grammar = grammar
    elif choice is not None:
        structured.choice.SetInParent()  # sent even when empty: the server names the field
        structured.choice.choices.extend(choice)
    else:
        return None
    return structured
