"""A JSON schema's strings as the engine compiles them (Grammars): a `pattern` is searched as
JSON Schema says and Python's `re.search` does, a length bound counts decoded characters, and
no string lets a raw control character through (which would make the output not JSON)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import xgrammar

from engine.models.hf_config import load_model_config
from engine.protocol.messages import Constraint
from engine.structured.grammars import ConstraintError, Grammars

# Patterns and strings to try them on; `re.search` is the reference.
LOCALE = "^[a-z]{2,3}(-[a-z]{5,8})?$"  # xgrammar 0.2.8 alone accepts "abcd"
PATTERNS = [
    LOCALE,
    "[a-z]{2}(-[a-z]+)?",
    r"^\d{3}-\d{4}$",
    r"^(?:ab|c)+x?$",
    r"^$|^\+?([\d\s()-]){9,20}$",  # a real phone-number schema's
    r'^["\\/]\w*$',
    r"^[^a-c]{1,3}$",
    r"^\S+@\S+\.[a-z]{2,}$",
    r"^[\x00-\x1f]*$",
    "^(https|file)://",  # a real schema's: a prefix, searched
    r"-\d",
    "b$|^x",
]
STRINGS = [
    "abcd",
    "ab",
    "abc-abcde",
    "toquumentili",
    "ab-abc",
    "555-1234",
    "55-1234",
    "ababc",
    "abx",
    "",
    '"q_1',
    "\\",
    "/9",
    "xyz",
    "a b",
    "\n",
    "\x00\x1f",
    "é€😀",
    "me@host.io",
    "me@host",
    "+1 (555) 123-4567",
    "https://example.com/a",
    "file:///tmp",
    "ftp://x",
    "xy-9",
]


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> Iterator[Grammars]:
    cfg = load_model_config(tiny_llama, None)
    grammars = Grammars(tiny_llama, cfg.vocab_size, cfg.eos_token_ids)
    yield grammars
    grammars.close()  # its compile workers


def accepts(grammars: Grammars, schema: dict[str, object], text: str) -> bool:
    compiled = grammars.compile(Constraint("json_schema", json.dumps(schema))).result()
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_accepts_exactly_the_strings_python_re_search_matches(
    grammars: Grammars, pattern: str
) -> None:
    schema = {"type": "string", "pattern": pattern}
    for text in STRINGS:
        # ECMA-262's $ is the end of the string; Python's also matches before a final "\n".
        expected = re.search(pattern.replace("$", r"\Z"), text) is not None
        assert accepts(grammars, schema, json.dumps(text, ensure_ascii=False)) == expected, text


def test_the_locale_pattern_inside_an_object_refuses_what_xgrammar_alone_accepts(
    grammars: Grammars,
) -> None:
    schema = {
        "type": "object",
        "properties": {"locale": {"type": "string", "pattern": LOCALE}},
        "required": ["locale"],
    }
    assert accepts(grammars, schema, '{"locale": "en-gbrit"}')
    assert not accepts(grammars, schema, '{"locale": "toquumentili"}')
    assert not accepts(grammars, schema, '{"locale": "abcd"}')


@pytest.mark.parametrize("schema_type", ["string", ["string", "null"]])
def test_a_length_bound_refuses_raw_control_characters(
    grammars: Grammars, schema_type: object
) -> None:
    schema = {"type": schema_type, "minLength": 1, "maxLength": 4}
    for code in range(0x20):
        assert not accepts(grammars, schema, f'"a{chr(code)}"'), hex(code)
        assert accepts(grammars, schema, json.dumps(f"a{chr(code)}"))  # escaped, it is JSON


def test_a_length_bound_counts_decoded_characters(grammars: Grammars) -> None:
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    for text in ["a", "ab", 'a"\\', "\n\t", "é😀", "abcd", "\\\\\\\\"]:
        expected = 2 <= len(text) <= 3
        assert accepts(grammars, schema, json.dumps(text, ensure_ascii=False)) == expected, text


def test_a_pattern_the_dialect_lacks_is_refused_naming_the_field(grammars: Grammars) -> None:
    bad = Constraint("json_schema", json.dumps({"type": "string", "pattern": r"(a)\1"}))
    with pytest.raises(ConstraintError, match=r"^structured.json_schema: pattern at # backref"):
        grammars.compile(bad).result()


def test_a_type_beside_any_of_is_enforced_as_jsonschema_says(grammars: Grammars) -> None:
    schema = {"type": ["integer", "string"], "anyOf": [{"minimum": 3}, {"maxLength": 2}]}
    validator = jsonschema.Draft202012Validator(schema)
    for value in [1, 3, 7, 2.5, "ab", "abc", None, [], True]:
        assert accepts(grammars, schema, json.dumps(value)) == validator.is_valid(value), value
