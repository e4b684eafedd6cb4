"""Real schemas (a JSONSchemaBench sample, jsonschemabench/README.md) as the engine compiles
them: each is refused naming what is not enforced, or its grammar accepts only what
`jsonschema` accepts (over the benchmark's own valid and invalid instances) and only what
`json.loads` parses (those instances with a raw control character put in a string)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar

from engine.models.hf_config import load_model_config
from engine.protocol.messages import Constraint
from engine.structured.grammars import ConstraintError, Grammars

CORPUS = sorted((Path(__file__).parent / "jsonschemabench").glob("*.json"))
REFUSAL = re.compile(r"^structured\.json_schema: .+ at #\S*( |$)")


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> Iterator[Grammars]:
    cfg = load_model_config(tiny_llama, None)
    grammars = Grammars(tiny_llama, cfg.vocab_size, cfg.eos_token_ids)
    yield grammars
    grammars.close()  # its compile workers


def compact(value: Any) -> str:
    """As the default whitespace writes JSON (", " and ": ")."""
    return json.dumps(value, ensure_ascii=False)


def accepts(compiled: Any, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def with_control_characters(text: str) -> list[str]:
    """`text` with U+0001 put raw right after the opening quote of each of its strings (at
    most 8): never JSON."""
    out, in_string, escaped = [], False, False
    for i, char in enumerate(text):
        if in_string:
            escaped = not escaped and char == "\\"
            in_string = escaped or char != '"'
        elif char == '"':
            in_string = True
            out.append(text[: i + 1] + "\x01" + text[i + 1 :])
    return out[:8]


def test_the_corpus_is_there() -> None:
    assert len(CORPUS) >= 40


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_a_real_schema_is_refused_or_its_grammar_accepts_only_valid_json(
    grammars: Grammars, path: Path
) -> None:
    case = json.loads(path.read_text())
    schema, instances = case["schema"], case["tests"]
    try:
        compiled = grammars.compile(Constraint("json_schema", json.dumps(schema))).result()
    except ConstraintError as exc:
        assert REFUSAL.match(str(exc)), str(exc)
        return
    validator = jsonschema.validators.validator_for(schema)(schema)
    accepted_valid = 0
    for instance in instances:
        text = compact(instance["data"])
        if accepts(compiled, text):
            assert validator.is_valid(instance["data"]), text
            accepted_valid += 1
            for broken in with_control_characters(text):
                with pytest.raises(ValueError):
                    json.loads(broken)
                assert not accepts(compiled, broken), broken
    assert accepted_valid > 0 or not any(validator.is_valid(i["data"]) for i in instances)
