"""The pieces under constrained generation: the bitmask applied as xgrammar applies it, the
compile cache, and choice lists turned into grammars that accept exactly their strings."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xgrammar

from engine.models.hf_config import load_model_config
from engine.protocol.messages import Constraint
from engine.sampling.surface import apply_surface
from engine.structured.grammars import ConstraintError, Grammars
from tests.support.fixed_bitmask import FixedBitmask


@pytest.fixture(scope="module")
def grammars(tiny_llama: Path) -> Iterator[Grammars]:
    cfg = load_model_config(tiny_llama, None)
    grammars = Grammars(tiny_llama, cfg.vocab_size, cfg.eos_token_ids, capacity=2)
    yield grammars
    grammars.close()  # its compile workers


def test_the_mask_sets_exactly_the_tokens_xgrammar_sets_to_minus_inf() -> None:
    rows, vocab = 5, 1000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[2] = -1  # a row that allows everything
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    ours = apply_surface(logits, None, None, None, None, FixedBitmask(bitmask))
    assert torch.equal(ours, expected)
    assert torch.equal(ours[2], logits[2])


def test_equal_constraints_compile_once_and_the_cache_is_bounded(grammars: Grammars) -> None:
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    first = grammars.compile(a)
    assert grammars.compile(Constraint("regex", "a+")) is first
    grammars.compile(b)
    grammars.compile(c)  # capacity 2: `a` was the least recently used
    assert grammars.compile(a) is not first
    assert first.result() is not None


def test_a_failed_compile_is_kept_and_names_the_field(grammars: Grammars) -> None:
    bad = Constraint("grammar", 'start ::= "a"')
    failed = grammars.compile(bad)
    with pytest.raises(ConstraintError, match=r'^structured.grammar: .*root rule with name "root"'):
        failed.result()
    assert grammars.compile(bad) is failed


def test_a_choice_grammar_accepts_exactly_its_strings(grammars: Grammars) -> None:
    choices = ('say "hi"', "back\\slash", "new\nline", "café ☕", "tab\there")
    compiled = grammars.compile(Constraint("choice", choices=choices)).result()
    for text in choices:
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string(text) and matcher.is_completed(), text
    for text in ('say "hi', "backslash", "new\\nline", "café"):
        matcher = xgrammar.GrammarMatcher(compiled)
        assert not (matcher.accept_string(text) and matcher.is_completed()), text


def test_a_regex_dot_matches_a_newline_as_documented(grammars: Grammars) -> None:
    """docs/service.md: xgrammar's regex dialect, where `.` (unlike Python's) is any character."""
    compiled = grammars.compile(Constraint("regex", "a.b")).result()
    for text, python in [("a\nb", False), ("axb", True)]:
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert matcher.accept_string(text) and matcher.is_terminated()
        assert (re.fullmatch("a.b", text) is not None) == python
