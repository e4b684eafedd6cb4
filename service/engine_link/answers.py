"""Answers: messages sent to the engine that wait for one answer each, by id.

InitWeightTransfer waits for its WeightTransferJoined, CheckConstraint for its
ConstraintChecked. A lost engine answers every waiting one with `lost(id, message)` (an
UNAVAILABLE answer: what it was asked is gone with it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Answers(Generic[T]):
    def __init__(self, lost: Callable[[str, str], T]) -> None:
        self._waiting: dict[str, asyncio.Future[T]] = {}
        self._lost = lost

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, answer_id: str) -> asyncio.Future[T]:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting[answer_id] = future
        return future

    def discard(self, answer_id: str) -> None:
        """Nobody waits for this answer any more (its caller left)."""
        self._waiting.pop(answer_id, None)

    def route(self, answer_id: str, answer: T) -> bool:
        """False if nothing waits for it."""
        future = self._waiting.pop(answer_id, None)
        if future is None:
            return False
        if not future.done():
            future.set_result(answer)
        return True

    def fail_all(self, message: str) -> None:
        waiting, self._waiting = self._waiting, {}
        for answer_id, future in waiting.items():
            if not future.done():
                future.set_result(self._lost(answer_id, message))
