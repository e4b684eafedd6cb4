"""EngineState: where the service's engine stands, as the EngineClient reports it."""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
