"""UpdateRoutes: the one weight-update slot, and where each update's progress goes.

The EngineClient claims the slot for an update (or a weight-transfer join) before it sends
anything, keeps one UpdateRoute per update it has sent and the engine has not yet finished,
and routes each WeightsProgress by its update id. An update's final message frees the slot
(a replayed update never held it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import UpdateWeights, WeightsPhase, WeightsProgress
from service.engine_link.awaiting_answers import AwaitingAnswers


class UpdateInProgressError(RuntimeError):
    """The one weight-update slot is taken."""


@dataclass
class UpdateRoute:
    """Where one weight update's progress goes, until its final message."""

    update: UpdateWeights
    queue: asyncio.Queue[WeightsProgress]
    on_final: Callable[[WeightsProgress], None] | None
    replay: bool  # re-applied to a restarted engine: changes neither the version nor the log
    fingerprint: str | None = None  # a checkpoint's, when it was sent (ReplayLog.changed)


class UpdateRoutes:
    def __init__(self) -> None:
        self.claimed = False  # the slot: an update being received, sent or applied
        self._live: str | None = None  # the id of the update holding the slot, once sent
        # sent to the engine, no final message yet
        self._routes: AwaitingAnswers[WeightsProgress] = AwaitingAnswers(
            lambda update_id, why: WeightsProgress(
                update_id, WeightsPhase.FAILED, error_code=ErrorCode.UNAVAILABLE, message=why
            ),
            final=lambda progress: progress.final,
        )

    def __len__(self) -> int:
        return len(self._routes)

    def claim(self) -> None:
        """Take the slot; UpdateInProgressError if it is taken."""
        if self.claimed:
            raise UpdateInProgressError("another weight update is in progress")
        self.claimed = True

    def release(self) -> None:
        """Free the slot of an update that was never sent."""
        assert self._live is None, "release a sent update"
        self.claimed = False

    def add(
        self,
        update: UpdateWeights,
        on_final: Callable[[WeightsProgress], None] | None,
        replay: bool,
        on_progress: Callable[[UpdateRoute, WeightsProgress], None],
    ) -> UpdateRoute:
        """Route the progress of a sent update: `on_progress` takes each event (the slot is
        free by its final one), and delivers it. A lost engine's event is a final FAILED
        UNAVAILABLE."""
        route = UpdateRoute(update, asyncio.Queue(), on_final, replay)
        if not replay:
            self._live = update.update_id
        self._routes.add(
            update.update_id, lambda progress: self._progress(route, progress, on_progress)
        )
        return route

    def route(self, progress: WeightsProgress) -> bool:
        """Hand `progress` to its update's route; False if no update waits for it."""
        return self._routes.route(progress.update_id, progress)

    def fail_all(self, message: str) -> None:
        """Every update in flight ends FAILED UNAVAILABLE (the engine was lost)."""
        self._routes.fail_all(message)

    def _progress(
        self,
        route: UpdateRoute,
        progress: WeightsProgress,
        on_progress: Callable[[UpdateRoute, WeightsProgress], None],
    ) -> None:
        if progress.final and not route.replay:
            self.claimed, self._live = False, None
        on_progress(route, progress)


def deliver(route: UpdateRoute, progress: WeightsProgress) -> None:
    """Queue `progress` for the update's caller; run its `on_final` if it is the last."""
    route.queue.put_nowait(progress)
    if progress.final and route.on_final is not None:
        route.on_final(progress)
