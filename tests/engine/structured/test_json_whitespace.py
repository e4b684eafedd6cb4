"""Whitespace in constrained JSON: compact by default (", " and ": " only, as vLLM's
disable_any_whitespace), so a model cannot emit newlines until max_tokens; `json_whitespace`
N allows any JSON whitespace in runs of at most N characters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import xgrammar

from engine.models.hf_config import load_model_config
from engine.protocol.config import MAX_JSON_WHITESPACE, EngineConfig
from engine.protocol.messages import Constraint
from engine.structured.grammars import Grammars

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "array"}}, "required": ["a"]})
VALUE = {"a": [1, "x y"]}


def make_grammars(model: Path, json_whitespace: int) -> Grammars:
    cfg = load_model_config(model, None)
    return Grammars(model, cfg.vocab_size, cfg.eos_token_ids, json_whitespace=json_whitespace)


def accepts(grammars: Grammars, constraint: Constraint, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(
        grammars.compile(constraint).result(), terminate_without_stop_token=True
    )
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.fixture(scope="module")
def compact(tiny_llama: Path) -> Iterator[Grammars]:
    grammars = make_grammars(tiny_llama, 0)
    yield grammars
    grammars.close()  # its compile workers


@pytest.fixture(scope="module")
def loose(tiny_llama: Path) -> Iterator[Grammars]:
    grammars = make_grammars(tiny_llama, 3)
    yield grammars
    grammars.close()


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_by_default_json_is_compact(compact: Grammars, kind: str) -> None:
    constraint = Constraint(kind, SCHEMA if kind == "json_schema" else "")
    assert accepts(compact, constraint, json.dumps(VALUE))  # ", " and ": " as json.dumps
    for text in ['{"a":[1,"x y"]}', '{ "a": [1, "x y"]}', '{"a": [1, "x y"]}\n', '\n{"a": []}']:
        assert not accepts(compact, constraint, text), text
    # No way to go on with whitespace: after "{" only a key (or "}" for an object) can follow.
    matcher = xgrammar.GrammarMatcher(compact.compile(constraint).result())
    assert matcher.accept_string("{") and not matcher.accept_string("\n")


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_json_whitespace_allows_runs_of_at_most_its_count(loose: Grammars, kind: str) -> None:
    constraint = Constraint(kind, SCHEMA if kind == "json_schema" else "")
    assert accepts(loose, constraint, '{\n  "a":\t[ 1 ,"x y"]\n}')
    assert accepts(loose, constraint, json.dumps(VALUE, indent=1))  # "\n" and 2 spaces at most
    assert not accepts(loose, constraint, '{\n\n\n\n"a": []}')


@pytest.mark.parametrize("count", [-1, MAX_JSON_WHITESPACE + 1])
def test_a_json_whitespace_out_of_bounds_is_refused_at_start(count: int) -> None:
    with pytest.raises(ValueError, match=f"json_whitespace: must be 0 to {MAX_JSON_WHITESPACE}"):
        EngineConfig(json_whitespace=count)
