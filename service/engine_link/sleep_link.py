"""SleepLink: the service's side of sleep and wake.

It keeps the level the server sleeps at (`level`, 0 awake), which outlives the engine process:
a restarted engine is put back to sleep at that level once it has replayed the weight updates
(EngineClient.replay). It also holds the one Sleep or Wake the engine is answering (`busy`):
Admin actions run one at a time, and the answer (SleepOutcome) resolves the waiting call. A lost
engine answers every waiting call UNAVAILABLE.
"""

from __future__ import annotations

import asyncio

from engine.protocol.messages import SleepOutcome


class SleepLink:
    def __init__(self) -> None:
        self.level = 0
        self._waiting: dict[str, asyncio.Future[SleepOutcome]] = {}

    @property
    def busy(self) -> bool:
        return bool(self._waiting)

    def expect(self, sleep_id: str) -> asyncio.Future[SleepOutcome]:
        """The future the engine's answer to `sleep_id` resolves."""
        assert sleep_id not in self._waiting, sleep_id
        future: asyncio.Future[SleepOutcome] = asyncio.get_running_loop().create_future()
        self._waiting[sleep_id] = future
        return future

    def forget(self, sleep_id: str) -> None:
        """The message was never sent."""
        self._waiting.pop(sleep_id, None)

    def route(self, outcome: SleepOutcome) -> bool:
        """Resolve the call `outcome` answers and take its level; False if none waits."""
        future = self._waiting.pop(outcome.sleep_id, None)
        if future is None:
            return False
        if outcome.ok:
            self.level = outcome.level
        if not future.done():
            future.set_result(outcome)
        return True

    def fail_all(self, message: str) -> None:
        """The engine is lost: every waiting call fails UNAVAILABLE; the level stays."""
        waiting, self._waiting = self._waiting, {}
        for sleep_id, future in waiting.items():
            if not future.done():
                failed = SleepOutcome(sleep_id, self.level, "UNAVAILABLE", message)
                future.set_result(failed)
