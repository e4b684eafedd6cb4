"""What a json_schema constraint may use: every keyword enforced exactly, or refused naming the
keyword and where it is; and a schema's nesting bounded before it is parsed."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from engine.protocol.validation.schema_rules import (
    MAX_DEPTH,
    MAX_PATTERN_CHARS,
    SchemaRuleError,
    check_schema,
)

OBJECT_A = {"type": "object", "properties": {"a": {"type": "integer"}}}

# (schema, the refusal's message): each a keyword xgrammar 0.2.8 ignores or gets wrong.
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"type": "object", "allOf": [OBJECT_A]}, "allOf at # is not supported"),
    ({**OBJECT_A, "anyOf": [{"required": ["a"]}]}, "properties beside anyOf at #"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf at # is supported only"),
    ({"oneOf": [OBJECT_A, {"type": "object"}]}, "oneOf at # is supported only"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "if at # is not supported"),
    ({**OBJECT_A, "dependencies": {"a": ["b"]}}, "dependencies at # is not supported"),
    ({"not": {"type": "integer"}}, "not at # is not supported"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems at # is not supported"),
    ({"type": "string", "pattern": "^a", "maxLength": 2}, "maxLength beside pattern at #"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf at # needs a type of integer"),
    ({"type": "integer", "multipleOf": 0.5}, "multipleOf at # must be a whole number"),
    ({"type": "integer", "multipleOf": 12, "minimum": 0}, "minimum beside multipleOf at #"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains at # is not supported"),
    ({**OBJECT_A, "required": ["b"]}, "required 'b' at # is not in properties"),
    ({"minimum": 3}, "minimum at # needs a type of integer or number"),
    ({"minLength": 3}, "minLength at # needs a type of string"),
    ({"$ref": "https://example.com/s.json"}, "$ref 'https://example.com/s.json' at #"),
    ({"$ref": "#/$defs/x"}, "$ref '#/$defs/x' at # does not resolve"),
    ({"$defs": {"x": {}}, "$ref": "#/$defs/x", "type": "string"}, "type beside $ref at #"),
    ({"type": "integer", "enum": ["a"]}, "enum at # has no value of the schema's type"),
    ({"type": "string", "enum": ["a"], "maxLength": 3}, "maxLength beside enum at #"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties at #"),
    ({"type": "string", "pattern": "(?=a)a"}, "pattern at # lookahead and lookbehind"),
    ({"type": "string", "pattern": "(" * 600 + ")" * 600}, "pattern at # nests groups more"),
]


@pytest.mark.parametrize(("schema", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_a_keyword_not_enforced_exactly_is_refused_naming_it(
    schema: dict[str, Any], message: str
) -> None:
    with pytest.raises(SchemaRuleError, match="^" + _literal(message)):
        check_schema(json.dumps(schema))


def test_the_refusal_names_the_path_of_a_nested_keyword() -> None:
    schema = {
        "type": "object",
        "properties": {"a/b": {"type": "array", "items": {"anyOf": [{"not": {}}]}}},
    }
    with pytest.raises(SchemaRuleError, match=r"^not at #/properties/a~1b/items/anyOf/0 is not"):
        check_schema(json.dumps(schema))


def test_a_ref_target_anywhere_in_the_schema_is_checked() -> None:
    schema = {"$ref": "#/components/x", "components": {"x": {"allOf": [{}]}}}
    with pytest.raises(SchemaRuleError, match=r"^allOf at #/components/x is not supported"):
        check_schema(json.dumps(schema))


def test_a_recursive_ref_is_checked_once() -> None:
    schema = {**OBJECT_A, "properties": {"child": {"$ref": "#"}}}
    assert json.loads(check_schema(json.dumps(schema)).text) == schema


def test_one_of_with_distinct_types_is_enforced_as_any_of() -> None:
    options = [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]
    checked = json.loads(check_schema(json.dumps({"oneOf": options})).text)
    assert checked == {"anyOf": options}


def test_an_enum_keeps_only_the_values_of_its_type() -> None:
    schema = {"type": ["integer", "null"], "enum": [1, "a", None, 2.0, 2.5, True]}
    assert json.loads(check_schema(json.dumps(schema)).text)["enum"] == [1, None, 2.0]


def test_lengths_and_patterns_become_placeholders_with_their_grammar() -> None:
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[a-z]{2}$"},
            "name": {"type": ["string", "null"], "minLength": 1, "maxLength": 8},
        },
    }
    checked = check_schema(json.dumps(schema))
    rewritten = json.loads(checked.text)["properties"]
    assert set(checked.strings) == {rewritten["code"]["pattern"], rewritten["name"]["pattern"]}
    assert "minLength" not in rewritten["name"] and "maxLength" not in rewritten["name"]


def test_annotations_and_unknown_keywords_are_kept() -> None:
    schema = {"title": "t", "description": "d", "x-extra": 1, "type": "integer", "default": 3}
    assert json.loads(check_schema(json.dumps(schema)).text) == schema


@pytest.mark.parametrize("opening", ["[", '{"a":', '{"properties":{"a":'])
def test_a_schema_nested_past_the_bound_is_refused_before_it_is_parsed(opening: str) -> None:
    depth = sys.getrecursionlimit() * 20
    closing = "]" if opening == "[" else "}"
    text = opening * depth + "1" + closing * (depth * opening.count("{") or depth)
    levels = depth * (opening.count("{") + opening.count("["))
    with pytest.raises(SchemaRuleError, match=rf"^is nested {levels} deep, more than {MAX_DEPTH}"):
        check_schema(text)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    schema = {"type": "string", "description": "[" * 1000 + '\\"{' * 100}
    assert json.loads(check_schema(json.dumps(schema)).text) == schema


def test_nesting_at_the_bound_is_accepted() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_DEPTH // 2 - 1):  # each level adds two: the schema and `properties`
        schema = {"type": "object", "properties": {"a": schema}}
    check_schema(json.dumps(schema))


def _literal(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": [1]},
        {"type": "object", "properties": {}, "required": "a"},
        {"type": "object", "properties": {}, "required": [1]},
        {"anyOf": {}},
        {"oneOf": []},
        {"enum": 5},
        {"$defs": []},
        {"type": 5},
        {"type": "string", "maxLength": 1e300},
        {"type": "string", "minLength": -1},
        {"type": "string", "minLength": None},
        {"type": "string", "pattern": 5},
    ],
)
def test_a_keyword_of_the_wrong_json_type_is_refused_not_a_crash(schema: dict[str, Any]) -> None:
    with pytest.raises(SchemaRuleError, match=" at # must "):
        check_schema(json.dumps(schema))


def test_an_array_bound_without_items_allows_any_items() -> None:
    schema = {"type": "array", "minItems": 1}
    assert json.loads(check_schema(json.dumps(schema)).text) == {**schema, "items": True}


def test_patterns_past_their_budget_are_refused() -> None:
    half = "a" * (MAX_PATTERN_CHARS // 2 + 1)
    properties = {k: {"type": "string", "pattern": half} for k in "xy"}
    with pytest.raises(SchemaRuleError, match=f"^patterns: at most {MAX_PATTERN_CHARS} char"):
        check_schema(json.dumps({"type": "object", "properties": properties}))


@pytest.mark.parametrize("unit", [".", r"\S", "[^a]", "(a|é)", "\\\\"])
def test_the_grammar_of_a_pattern_grows_with_it_not_with_its_character_sets(unit: str) -> None:
    pattern = unit * (MAX_PATTERN_CHARS // len(unit))
    checked = check_schema(json.dumps({"type": "string", "pattern": pattern}))
    written = sum(map(len, checked.strings.values())) + sum(map(len, checked.rules.values()))
    assert written < 16 * len(pattern) + 4096


@pytest.mark.timeout(5)  # quadratic, as a first version was, this text took 20 s
def test_nesting_is_measured_in_linear_time_even_in_a_string_that_never_ends() -> None:
    text = '{"a": "' + '\\"[' * 20000
    with pytest.raises(SchemaRuleError, match=r"^is not valid JSON"):
        check_schema(text)


def test_a_type_beside_any_of_moves_into_each_alternative() -> None:
    schema = {
        "type": ["integer", "string"],
        "anyOf": [{"type": "number", "minimum": 3}, {"maxLength": 2}, {"type": "null"}, True],
    }
    assert json.loads(check_schema(json.dumps(schema)).text) == {
        "anyOf": [
            {"type": ["integer"], "minimum": 3},
            {"type": ["integer", "string"], "pattern": "sluice_string_0"},
            {"type": ["integer", "string"]},
        ]
    }
