"""GrammarWaits: what waits for a constraint's compile, by id, until its grammar is done.

The engine waits for a grammar in two places, both here: a request whose grammar is still
compiling (it starts once it is compiled, outside the scheduler meanwhile) and a
CheckConstraint from the service (answered once it is compiled, so that a bad constraint is
refused before its request is sent). Each wait holds its grammar's future, its constraint and
what its owner needs once the grammar is done (`item`). A wait that ends early is abandoned,
and grammars.py cancels a compile nobody waits for any more. Called from the engine's thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from engine.protocol.messages import Constraint

if TYPE_CHECKING:
    from engine.structured.grammars import Grammars

T = TypeVar("T")


class GrammarWait(NamedTuple, Generic[T]):
    grammar: Future[Any]
    constraint: Constraint
    item: T


class GrammarWaits(Generic[T]):
    def __init__(self, grammars: Grammars) -> None:
        self._grammars = grammars
        self._waits: dict[str, GrammarWait[T]] = {}

    def __len__(self) -> int:
        return len(self._waits)

    def __contains__(self, wait_id: object) -> bool:
        return wait_id in self._waits

    def __iter__(self) -> Iterator[str]:
        return iter(self._waits)

    def add(self, wait_id: str, grammar: Future[Any], constraint: Constraint, item: T) -> None:
        self._waits[wait_id] = GrammarWait(grammar, constraint, item)

    @property
    def ready(self) -> bool:
        """Some wait's grammar is done (compiled, failed or cancelled)."""
        return any(wait.grammar.done() for wait in self._waits.values())

    def futures(self) -> list[Future[Any]]:
        return [wait.grammar for wait in self._waits.values()]

    def take_done(self) -> list[tuple[str, GrammarWait[T]]]:
        """The waits whose grammar is done, in the order they began; they wait no more."""
        done = [(wait_id, w) for wait_id, w in self._waits.items() if w.grammar.done()]
        for wait_id, _ in done:
            del self._waits[wait_id]
        return done

    def abandon(self, wait_id: str) -> T | None:
        """The wait ended before its grammar was done (its caller left, its request was
        aborted); its item, or None if nothing waits under `wait_id`."""
        wait = self._waits.pop(wait_id, None)
        if wait is None:
            return None
        self._grammars.abandon(wait.constraint)
        return wait.item
