"""The Python client's structured-output keywords: what build_request puts in `structured`."""

from __future__ import annotations

import json

import pytest
from sluice_client import build_request, pb, structured_output

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_a_schema_dict_travels_as_json_text_and_a_string_as_it_is():
    request = build_request("Name a cat as JSON.", json_schema=SCHEMA, max_tokens=32)
    assert request.structured.WhichOneof("kind") == "json_schema"
    assert json.loads(request.structured.json_schema) == SCHEMA
    text = '{"type": "boolean"}'
    assert build_request("x", json_schema=text).structured.json_schema == text


@pytest.mark.parametrize(
    ("keywords", "kind", "value"),
    [
        ({"json_object": True}, "json_object", True),
        ({"regex": r"\d{3}"}, "regex", r"\d{3}"),
        ({"grammar": 'root ::= "yes" | "no"'}, "grammar", 'root ::= "yes" | "no"'),
        ({"choice": ["yes", "no"]}, "choice", pb.ChoiceList(choices=["yes", "no"])),
    ],
)
def test_each_keyword_sets_its_member_of_the_oneof(keywords, kind, value):
    structured = build_request("x", **keywords).structured
    assert structured.WhichOneof("kind") == kind
    assert getattr(structured, kind) == value


def test_no_constraint_leaves_structured_unset_and_json_object_false_is_unset():
    assert not build_request("x").HasField("structured")
    assert not build_request("x", json_object=False).HasField("structured")
    assert structured_output() is None


def test_an_empty_choice_list_is_still_sent_for_the_server_to_refuse():
    structured = build_request("x", choice=[]).structured
    assert structured.WhichOneof("kind") == "choice" and list(structured.choice.choices) == []


def test_two_constraints_are_a_value_error_naming_both():
    with pytest.raises(ValueError, match="got regex, choice"):
        build_request("x", regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="got json_schema, json_object"):
        structured_output(json_schema=SCHEMA, json_object=True)


def test_one_string_as_choice_is_a_type_error_not_a_list_of_its_letters():
    with pytest.raises(TypeError, match="list of strings"):
        build_request("x", choice="yes")
