"""StructuredOutputs: the engine's side of structured output, between the loop and grammars.py.

- A request whose grammar is still compiling waits here, not in the scheduler (`defer`): the
  steps go on without it, and `start_ready` starts it once its grammar is compiled (its start
  ends it with ERROR if the constraint did not compile).
- The service's CheckConstraint messages are answered once their grammar is compiled
  (`check`, then `verdicts`), so that a bad constraint is refused before its request is sent.
- Both wait in a GrammarWaits (grammar_waits.py); a wait that ends early (an AbandonCheck: its
  caller left; a deferred request aborted) tells grammars.py, which cancels a compile nobody
  waits for any more.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import Constraint, ConstraintChecked
from engine.structured.grammar_waits import GrammarWaits
from engine.structured.grammars import ConstraintError, Grammars


@dataclass
class Deferred:
    grammar: Future[Any]
    start: Callable[[], None]  # adds the request to the scheduler, or ends it
    n: int
    prompt_len: int
    constraint: Constraint


class StructuredOutputs:
    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self.deferred: GrammarWaits[Deferred] = GrammarWaits(grammars)  # by request id
        self.checks: GrammarWaits[None] = GrammarWaits(grammars)  # by CheckConstraint id

    def defer(self, request_id: str, deferred: Deferred) -> None:
        self.deferred.add(request_id, deferred.grammar, deferred.constraint, deferred)

    @property
    def ready(self) -> bool:
        """Some deferred request can start, or some check can be answered."""
        return self.deferred.ready or self.checks.ready

    def drop(self, request_id: str) -> Deferred | None:
        """Stop waiting for a deferred request's grammar (it was aborted); its wait, if any."""
        return self.deferred.abandon(request_id)

    def start_ready(self) -> None:
        for _, wait in self.deferred.take_done():
            wait.item.start()

    def check(self, check_id: str, constraint: Constraint, caller: str = "") -> None:
        self.checks.add(check_id, self.grammars.compile(constraint, caller), constraint, None)

    def abandon_check(self, check_id: str) -> None:
        """The check's caller left: it is not answered, and its compile may be cancelled."""
        self.checks.abandon(check_id)

    def verdicts(self) -> list[ConstraintChecked]:
        """The answers of the checks whose grammar is compiled (each once)."""
        answers = []
        for check_id, wait in self.checks.take_done():
            error = grammar_error(wait.grammar)
            code, message = error if error is not None else (None, "")
            answers.append(ConstraintChecked(check_id, code, message))
        return answers

    def wait(self, timeout: float) -> None:
        """Block until some deferred request's grammar is compiled, at most `timeout` s."""
        futures = self.deferred.futures()
        concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self.grammars.close()


def grammar_error(grammar: Future[Any]) -> tuple[ErrorCode, str] | None:
    """(error code, message) of a compiled grammar that failed, or None."""
    if grammar.cancelled():  # every waiter left; only a late look at it sees this
        return ErrorCode.CANCELLED, "structured: its compile was abandoned"
    exc = grammar.exception()
    if exc is None:
        return None
    if isinstance(exc, ConstraintError):
        return ErrorCode.INVALID_ARGUMENT, str(exc)
    message = f"structured: constraints cannot be compiled for this model: {exc!r}"
    return ErrorCode.FAILED_PRECONDITION, message
