"""EngineState: where the service's engine stands, as the EngineClient reports it."""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    SLEEPING = "sleeping"  # Admin Sleep, from the call until a Wake: requests are refused
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
