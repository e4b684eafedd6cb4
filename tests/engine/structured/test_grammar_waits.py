"""GrammarWaits: the one wait for a constraint's compile, for deferred requests and checks."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from engine.protocol.messages import Constraint
from engine.structured.grammar_waits import GrammarWaits

REGEX = Constraint("regex", "a+")


class Abandons:
    """Records the constraints whose waits ended early (what Grammars.abandon is told)."""

    def __init__(self) -> None:
        self.abandoned: list[Constraint] = []

    def abandon(self, constraint: Constraint) -> None:
        self.abandoned.append(constraint)


def waits() -> tuple[GrammarWaits[str], Abandons]:
    grammars = Abandons()
    return GrammarWaits(grammars), grammars  # type: ignore[arg-type]


def test_only_waits_whose_grammar_is_done_are_taken_in_the_order_they_began() -> None:
    table, _ = waits()
    pending, first, second = Future[Any](), Future[Any](), Future[Any]()
    for wait_id, grammar in (("p", pending), ("b", first), ("a", second)):
        table.add(wait_id, grammar, REGEX, wait_id.upper())
    assert not table.ready
    second.set_result("grammar")
    first.set_exception(ValueError("no"))
    assert table.ready
    assert [(i, w.item) for i, w in table.take_done()] == [("b", "B"), ("a", "A")]
    assert list(table) == ["p"] and not table.ready and table.take_done() == []


def test_an_abandoned_wait_tells_the_grammars_and_waits_no_more() -> None:
    table, grammars = waits()
    grammar = Future[Any]()
    table.add("r", grammar, REGEX, "item")
    assert table.abandon("r") == "item" and grammars.abandoned == [REGEX]
    assert "r" not in table and len(table) == 0
    assert table.abandon("r") is None and grammars.abandoned == [REGEX]  # told once
    grammar.set_result("late")
    assert table.take_done() == []


def test_futures_are_those_still_waited_for() -> None:
    table, _ = waits()
    a, b = Future[Any](), Future[Any]()
    table.add("a", a, REGEX, "")
    table.add("b", b, REGEX, "")
    table.abandon("a")
    assert table.futures() == [b]
