"""AwaitingAnswers: messages sent to the engine that wait for their answer, by id.

Every message the service awaits an answer to waits in one of these: UpdateWeights (its
WeightsProgress events, up to the final one), InitWeightTransfer (WeightTransferJoined),
CheckConstraint (ConstraintChecked), Sleep and Wake (SleepOutcome), and the adapter messages
(AdapterOutcome). An answer is handed to its waiter at once, on the event loop, when the
engine's message is routed; an answer that is not `final` keeps the waiter waiting for the
next. A lost engine answers every waiter `lost(id, message)`, an UNAVAILABLE answer: what it
was asked is gone with it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Generic, TypeVar

A = TypeVar("A")


def _always(_: object) -> bool:
    return True


class AwaitingAnswers(Generic[A]):
    def __init__(self, lost: Callable[[str, str], A], final: Callable[[A], bool] = _always) -> None:
        self._waiting: dict[str, Callable[[A], None]] = {}
        self._lost = lost
        self._final = final

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, answer_id: str) -> bool:
        return answer_id in self._waiting

    def add(self, answer_id: str, on_answer: Callable[[A], None]) -> None:
        """Wait for the answers to `answer_id`: `on_answer` takes each, the lost one too."""
        assert answer_id not in self._waiting, answer_id
        self._waiting[answer_id] = on_answer

    def expect(self, answer_id: str, then: Callable[[A], object] = _always) -> asyncio.Future[A]:
        """The future of the answer to `answer_id`; `then` sees the answer first (also when
        nobody awaits the future any more)."""
        future: asyncio.Future[A] = asyncio.get_running_loop().create_future()
        self.add(answer_id, functools.partial(_resolve, future, then))
        return future

    def discard(self, answer_id: str) -> None:
        """Nobody waits for this answer any more (its caller left, or it was never sent)."""
        self._waiting.pop(answer_id, None)

    def route(self, answer_id: str, answer: A) -> bool:
        """Hand `answer` to its waiter; False if nothing waits for it."""
        on_answer = self._waiting.get(answer_id)
        if on_answer is None:
            return False
        if self._final(answer):
            del self._waiting[answer_id]
        on_answer(answer)
        return True

    def fail_all(self, message: str) -> None:
        """The engine is lost: every waiter takes its lost answer and waits no more."""
        waiting, self._waiting = self._waiting, {}
        for answer_id, on_answer in waiting.items():
            on_answer(self._lost(answer_id, message))


def _resolve(future: asyncio.Future[A], then: Callable[[A], object], answer: A) -> None:
    then(answer)
    if not future.done():
        future.set_result(answer)
