"""SleepLink: the service's side of sleep and wake.

It keeps the level the server sleeps at (`level`, 0 awake), which outlives the engine process:
a restarted engine is put back to sleep at that level once it has replayed the weight updates
(EngineClient.replay). It also holds the one Sleep or Wake the engine is answering (`busy`):
Admin actions run one at a time, and the answer (SleepOutcome) resolves the waiting call. A lost
engine answers every waiting call UNAVAILABLE.
"""

from __future__ import annotations

import asyncio

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import SleepOutcome
from service.engine_link.awaiting_answers import AwaitingAnswers


class SleepLink:
    def __init__(self) -> None:
        self.level = 0
        self._waiting: AwaitingAnswers[SleepOutcome] = AwaitingAnswers(
            lambda sleep_id, why: SleepOutcome(sleep_id, self.level, ErrorCode.UNAVAILABLE, why)
        )

    @property
    def busy(self) -> bool:
        return bool(len(self._waiting))

    def expect(self, sleep_id: str) -> asyncio.Future[SleepOutcome]:
        """The future the engine's answer to `sleep_id` resolves; a successful answer sets
        the level (a lost engine's leaves it)."""
        return self._waiting.expect(sleep_id, then=self._take_level)

    def forget(self, sleep_id: str) -> None:
        """The message was never sent."""
        self._waiting.discard(sleep_id)

    def route(self, outcome: SleepOutcome) -> bool:
        """Resolve the call `outcome` answers; False if none waits."""
        return self._waiting.route(outcome.sleep_id, outcome)

    def fail_all(self, message: str) -> None:
        """The engine is lost: every waiting call fails UNAVAILABLE; the level stays."""
        self._waiting.fail_all(message)

    def _take_level(self, outcome: SleepOutcome) -> None:
        if outcome.ok:
            self.level = outcome.level
