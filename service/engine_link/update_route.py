"""UpdateRoute: where one weight update's progress goes, and the error for a taken update slot.

The EngineClient keeps one UpdateRoute per update it has sent and the engine has not yet
finished, and routes each WeightsProgress by its update id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from engine.messages import UpdateWeights, WeightsProgress


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
