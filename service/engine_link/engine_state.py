"""EngineState: where the service's engine stands, as the EngineClient reports it."""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    SLEEPING = "sleeping"  # Admin Sleep, from the call until a Wake: requests are refused
    # Restarted, but the replay log held weights received over a process group, which cannot
    # be replayed: generation is refused until an update replaces every tensor.
    AWAITING_WEIGHTS = "awaiting_weights"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"


# An engine that was serving in one of these states and is lost is RESTARTING at once: a
# request admitted before the Supervisor's next turn would go to the lost incarnation.
SERVED = frozenset({EngineState.SERVING, EngineState.SLEEPING, EngineState.AWAITING_WEIGHTS})
