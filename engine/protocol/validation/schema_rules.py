"""SchemaRules: which JSON Schema a `json_schema` constraint may use, and how Sluice rewrites it.

xgrammar 0.2.8 silently ignores much of JSON Schema (allOf's siblings, `not`, `if`,
`uniqueItems`, a `type`-less `minimum` ...), so an output could break the very schema it was
constrained by. `check_schema` admits only what is enforced exactly (docs/service.md lists it)
and refuses the rest with "<keyword> at <path> is not supported", the path a JSON pointer
into the schema ("#/properties/a/anyOf/0"). It also rewrites what xgrammar gets wrong: a
string's `pattern` and its `minLength`/`maxLength` become placeholders that
json_schema_grammar.py replaces by Sluice's own expressions (pattern_grammar.py).

Stdlib only: the service runs it at admission (without parsing patterns) and the engine again
before compiling. The text's nesting is measured before it is parsed, and the walk is a loop,
so no schema reaches Python's recursion limit (nor xgrammar's recursive converter).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine.protocol.validation.pattern_grammar import PatternError, PatternGrammar

MAX_DEPTH = 64  # nesting of arrays and objects in the schema's text
MAX_LENGTH = 2**31 - 1  # of a string's minLength and maxLength
MAX_PATTERN_CHARS = 8192  # all of a schema's patterns together: parsing them costs ~10 us a char
PLACEHOLDER = "sluice_string_{}"  # a pattern xgrammar keeps verbatim in its grammar's text

# Validating keywords xgrammar does not enforce (or not as JSON Schema means them).
UNSUPPORTED = frozenset(
    [
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "$dynamicRef",
        "$recursiveRef",
    ]
)
# Keywords that constrain one type only: xgrammar ignores them unless `type` names that type.
TYPED = {
    "minLength": {"string"},
    "maxLength": {"string"},
    "pattern": {"string"},
    "minimum": {"integer", "number"},
    "maximum": {"integer", "number"},
    "exclusiveMinimum": {"integer", "number"},
    "exclusiveMaximum": {"integer", "number"},
    "multipleOf": {"integer"},
    "minItems": {"array"},
    "maxItems": {"array"},
    "minProperties": {"object"},
    "maxProperties": {"object"},
}
# The validating keywords enforced, under the rules below. Anything else (title, description,
# $defs, x-...) annotates and constrains nothing.
SUPPORTED = frozenset(TYPED) | {
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "anyOf",
    "oneOf",
    "$ref",
    "uniqueItems",
}
_ESCAPE = re.compile(r"\\.", re.DOTALL)
_STRING = re.compile(r'"[^"]*"?')
_BRACKET = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class SchemaRuleError(ValueError):
    """The schema cannot be enforced exactly: the message says what and where."""


@dataclass
class CheckedSchema:
    """The schema as xgrammar should read it (`text`), the GBNF expression of each string
    placeholder in it (`strings`) and the rules those expressions use (`rules`)."""

    text: str
    strings: dict[str, str] = field(default_factory=dict)
    rules: dict[str, str] = field(default_factory=dict)
    pattern_chars: int = 0  # of the schema's patterns together


def check_schema(text: str, write_strings: bool = True) -> CheckedSchema:
    """The schema rewritten for compiling; raises SchemaRuleError if it is not JSON, not an
    object, nested deeper than MAX_DEPTH, or uses what is not enforced exactly. Without
    `write_strings` (the service's check) patterns are not parsed: the engine's check, before
    compiling, refuses one its dialect lacks."""
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise SchemaRuleError(f"is nested {depth} deep, more than {MAX_DEPTH}")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise SchemaRuleError(f"is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise SchemaRuleError("must be a JSON object")
    checked = CheckedSchema("")
    writer = PatternGrammar() if write_strings else None
    _walk(schema, checked, writer)
    checked.text = json.dumps(schema)
    checked.rules = writer.rules if writer is not None else {}
    return checked


def nesting_depth(text: str) -> int:
    """The deepest nesting of [ and { outside JSON strings, in linear time (a text that may not
    be JSON: past a stray closing bracket the depth counted may be less, but a parser stops
    there)."""
    outside = _STRING.sub("", _ESCAPE.sub("", text))  # no escape left: a string ends at a quote
    steps = map(_STEP.__getitem__, _BRACKET.findall(outside))
    return max(itertools.accumulate(steps, initial=0))


def _walk(root: dict[str, Any], checked: CheckedSchema, writer: PatternGrammar | None) -> None:
    stack: list[tuple[Any, str]] = [(root, "#")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue  # true and false are schemas too; a $ref target is checked once
        seen.add(id(node))
        _check_node(node, path)
        _rewrite_strings(node, path, checked, writer)
        if "$ref" in node:
            stack.append((_resolve(root, node["$ref"], path), node["$ref"]))
        stack += _children(node, path)


def _check_node(node: dict[str, Any], path: str) -> None:
    _check_shapes(node, path)
    keys = set(node)
    for key in sorted(keys & UNSUPPORTED):
        raise _unsupported(key, path)
    if node.get("uniqueItems", False) is not False:
        raise _unsupported("uniqueItems", path)
    if "additionalItems" in node:
        if isinstance(node.get("items"), list):
            raise _unsupported("additionalItems", path)
        del node["additionalItems"]  # without an array of `items` it constrains nothing
    types = _types(node, path)
    for key in ("anyOf", "oneOf"):
        if key in node and types is not None:
            _distribute_type(node, key, types, path)
            keys.discard("type")
            types = None
    for key in sorted(keys & set(TYPED)):
        if types is None or not types & TYPED[key]:
            need = " or ".join(sorted(TYPED[key]))
            raise SchemaRuleError(f"{key} at {path} needs a type of {need}")
    if "multipleOf" in node:
        if not _whole(node["multipleOf"]):
            raise SchemaRuleError(f"multipleOf at {path} must be a whole number")
        bounds = keys & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
        if bounds:  # xgrammar then enforces the range alone
            raise _unsupported(f"{sorted(bounds)[0]} beside multipleOf", path)
    validating = keys & SUPPORTED
    for key in ("anyOf", "oneOf", "$ref"):
        if key in keys and validating - {key}:
            other = sorted(validating - {key})[0]
            raise SchemaRuleError(f"{other} beside {key} at {path} is not supported")
    if keys & {"minItems", "maxItems"} and not keys & {"items", "prefixItems"}:
        node["items"] = True  # JSON Schema's default; xgrammar's strict mode reads none as [] here
    if "oneOf" in node:
        _check_one_of(node, path)
    if "enum" in node or "const" in node:
        _check_values(node, path, types, validating)
    if "required" in node:
        properties = node.get("properties", {})
        for name in node["required"]:
            if name not in properties:
                raise SchemaRuleError(f"required {name!r} at {path} is not in properties")


def _check_shapes(node: dict[str, Any], path: str) -> None:
    """The keywords this module reads have the JSON types it reads them as."""
    shapes = {
        "properties": dict,
        "$defs": dict,
        "definitions": dict,
        "required": list,
        "enum": list,
        "anyOf": list,
        "oneOf": list,
        "prefixItems": list,
    }
    for key, kind in shapes.items():
        if key in node and not isinstance(node[key], kind):
            noun = "an object" if kind is dict else "an array"
            raise SchemaRuleError(f"{key} at {path} must be {noun}")
    if not all(isinstance(name, str) for name in node.get("required", [])):
        raise SchemaRuleError(f"required at {path} must hold strings")
    for key in ("anyOf", "oneOf"):
        if key in node and not node[key]:
            raise SchemaRuleError(f"{key} at {path} must not be empty")


def _distribute_type(node: dict[str, Any], key: str, types: set[str], path: str) -> None:
    """A `type` beside anyOf/oneOf moved into each alternative (the same schema: each must
    hold with it), so that xgrammar, which ignores it there, enforces it; an alternative whose
    own type excludes it is dropped."""
    options = []
    for option in node[key]:
        if option is False:
            continue
        option = {} if option is True else option
        if not isinstance(option, dict) or "$ref" in option:
            raise _unsupported(f"type beside {key} with a $ref alternative", path)
        own = _types(option, path)
        kept = types if own is None else _type_intersection(types, own)
        if kept:
            options.append({**option, "type": sorted(kept)})
    if not options:
        raise SchemaRuleError(f"{key} at {path} has no alternative of the schema's type")
    node[key] = options
    del node["type"]


def _type_intersection(a: set[str], b: set[str]) -> set[str]:
    """The JSON types both allow: an integer is a number too."""
    both = a & b
    if ("integer" in a and "number" in b) or ("number" in a and "integer" in b):
        both.add("integer")
    return both


def _check_one_of(node: dict[str, Any], path: str) -> None:
    """oneOf is enforced as anyOf, so its alternatives must exclude each other: each a
    distinct single `type` (integer and number overlap)."""
    options = node["oneOf"]
    types = [o.get("type") if isinstance(o, dict) else None for o in options]
    distinct = all(isinstance(t, str) for t in types) and len(set(types)) == len(types)
    if not distinct or {"integer", "number"} <= set(types):
        raise SchemaRuleError(
            f"oneOf at {path} is supported only with alternatives of distinct single types"
        )
    node["anyOf"] = node.pop("oneOf")


def _check_values(
    node: dict[str, Any], path: str, types: set[str] | None, validating: set[str]
) -> None:
    """enum and const are enforced alone: only a `type` beside them, which filters them."""
    key = "enum" if "enum" in node else "const"
    others = validating - {"enum", "const", "type", "format"}  # format only annotates a value
    if others:
        raise SchemaRuleError(f"{sorted(others)[0]} beside {key} at {path} is not supported")
    values = node["enum"] if key == "enum" else [node["const"]]
    kept = [v for v in values if types is None or _value_types(v) & types]
    if not kept:
        raise SchemaRuleError(f"{key} at {path} has no value of the schema's type")
    node.pop("format", None)
    if key == "enum":
        node["enum"] = kept


def _rewrite_strings(
    node: dict[str, Any], path: str, checked: CheckedSchema, writer: PatternGrammar | None
) -> None:
    """Replace `pattern` or `minLength`/`maxLength` by a placeholder pattern, its expression
    written by `writer` (none: only checked, "" as the expression)."""
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if "pattern" in node:
        if lengths:
            raise _unsupported(f"{lengths[0]} beside pattern", path)
        if not isinstance(node["pattern"], str):
            raise SchemaRuleError(f"pattern at {path} must be a string")
        checked.pattern_chars += len(node["pattern"])
        if checked.pattern_chars > MAX_PATTERN_CHARS:
            raise SchemaRuleError(f"patterns: at most {MAX_PATTERN_CHARS} characters in all")
        try:
            body = writer.pattern(node["pattern"]) if writer is not None else node["pattern"]
        except PatternError as exc:
            raise SchemaRuleError(f"pattern at {path} {exc}") from None
    elif lengths:
        for key in lengths:
            if not (_whole(node[key]) and 0 <= node[key] <= MAX_LENGTH):
                raise SchemaRuleError(f"{key} at {path} must be a whole number 0 to {MAX_LENGTH}")
        low, high = node.pop("minLength", 0), node.pop("maxLength", None)
        bounds = (int(low), None if high is None else int(high))
        body = writer.length(*bounds) if writer is not None else ""
    else:
        return
    # A format beside them stays what JSON Schema makes it by default: an annotation.
    node.pop("format", None)
    name = PLACEHOLDER.format(len(checked.strings))
    checked.strings[name] = body
    node["pattern"] = name


def _children(node: dict[str, Any], path: str) -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = []
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            out += [(v, f"{path}/{key}/{_escape(k)}") for k, v in node[key].items()]
    for key in ("additionalProperties", "items"):
        if key in node:
            out.append((node[key], f"{path}/{key}"))
    for key in ("prefixItems", "anyOf"):
        if isinstance(node.get(key), list):
            out += [(v, f"{path}/{key}/{i}") for i, v in enumerate(node[key])]
    return out


def _resolve(root: dict[str, Any], ref: Any, path: str) -> Any:
    """The schema a local $ref points to ("#", "#/$defs/a"); others are refused."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise SchemaRuleError(
            f"$ref {ref!r} at {path} is not supported (only JSON pointers into the schema)"
        )
    target: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise SchemaRuleError(f"$ref {ref!r} at {path} does not resolve")
    return target


def _types(node: dict[str, Any], path: str) -> set[str] | None:
    kind = node.get("type")
    if kind is None:
        return None
    names = [kind] if isinstance(kind, str) else kind
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise SchemaRuleError(f"type at {path} must be a string or an array of strings")
    return set(names)


def _value_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return (
        {"string"} if isinstance(value, str) else {"array" if isinstance(value, list) else "object"}
    )


def _whole(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _unsupported(key: str, path: str) -> SchemaRuleError:
    return SchemaRuleError(f"{key} at {path} is not supported")
