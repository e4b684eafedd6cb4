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

from engine.protocol.messages import UpdateWeights, WeightsPhase, WeightsProgress


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
        self._routes: dict[str, UpdateRoute] = {}  # sent to the engine, no final message yet

    def __len__(self) -> int:
        return len(self._routes)

    def claim(self) -> None:
        """Take the slot; UpdateInProgressError if it is taken."""
        if self.claimed:
            raise UpdateInProgressError("another weight update is in progress")
        self.claimed = True

    def release(self) -> None:
        """Free the slot of an update that was never sent."""
        assert all(r.replay for r in self._routes.values()), "release a sent update"
        self.claimed = False

    def add(
        self,
        update: UpdateWeights,
        on_final: Callable[[WeightsProgress], None] | None,
        replay: bool,
    ) -> UpdateRoute:
        assert update.update_id not in self._routes, update.update_id
        route = UpdateRoute(update, asyncio.Queue(), on_final, replay)
        self._routes[update.update_id] = route
        return route

    def pop_route(self, progress: WeightsProgress) -> UpdateRoute | None:
        """The route of `progress`, dropped (and the slot freed) if it is final; None if
        unknown."""
        route = self._routes.get(progress.update_id)
        if route is not None and progress.final:
            del self._routes[progress.update_id]
            if not route.replay:
                self.claimed = False
        return route

    def fail_all(self, message: str) -> None:
        """Every update in flight ends FAILED UNAVAILABLE (the engine was lost)."""
        routes, self._routes = self._routes, {}
        for update_id, route in routes.items():
            failed = WeightsProgress(
                update_id, WeightsPhase.FAILED, error_code="UNAVAILABLE", message=message
            )
            if not route.replay:
                self.claimed = False
            deliver(route, failed)


def deliver(route: UpdateRoute, progress: WeightsProgress) -> None:
    """Queue `progress` for the update's caller; run its `on_final` if it is the last."""
    route.queue.put_nowait(progress)
    if progress.final and route.on_final is not None:
        route.on_final(progress)
