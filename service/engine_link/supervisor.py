"""Supervisor: keeps an engine serving. Watches the current engine process and replaces it
when it is lost.

The engine is lost when it says so (EngineDead), its pipe closes, its process exits, or it makes
no progress: no message for `stall_timeout` seconds while requests or updates wait on it. An
idle engine sends a Heartbeat every second; a late one is judged by Liveness (liveness.py): the
engine is probed, and it is hung when it is stopped, or sleeps through the probe for
`heartbeat_timeout` seconds, or stays silent for `stall_timeout` though runnable (starved of CPU,
or spinning). A lost
engine is killed, every in-flight request ends with ERROR, and a new one is started with bounded
exponential backoff; it serves again only once the replay log has been re-applied to it, so the
policy version and the weights never go backwards. A log it cannot replay (weights received
over a process group) leaves the new engine AWAITING_WEIGHTS instead: generation is refused
until an update replaces every tensor. A server that slept when its engine was lost stays
asleep: the new engine is put back to sleep after the replay (state SLEEPING). Nothing that
goes wrong while restarting
stops the supervisor: it tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import structlog

from engine.protocol.messages import GetState
from service.config import ServiceConfig
from service.engine_link.engine_process import (
    EngineProcess,
    EngineStartError,
    EngineUnavailableError,
)
from service.engine_link.engine_state import EngineState
from service.engine_link.liveness import Liveness
from service.ops.metrics import Metrics

log = structlog.get_logger("sluice.supervisor")

WATCH_INTERVAL_S = 0.5


class Supervised(Protocol):
    """What the Supervisor reads and calls on the engine's owner (the EngineClient)."""

    restarts: int

    @property
    def config(self) -> ServiceConfig: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def engine(self) -> EngineProcess | None: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    @property
    def ready_state(self) -> EngineState: ...
    def set_state(self, state: EngineState) -> None: ...
    def lose(self, engine: EngineProcess, reason: str) -> None: ...
    async def launch(self) -> object: ...
    async def replay(self) -> None: ...


class Supervisor:
    def __init__(self, client: Supervised) -> None:
        self.client = client
        self.config = client.config

    async def run(self) -> None:
        while True:
            engine = self.client.engine
            assert engine is not None
            await self._watch(engine)
            if self.client.stopping:
                return
            self.client.set_state(EngineState.RESTARTING)
            await engine.close(timeout=0)
            await self._restart()
            self.client.restarts += 1
            self.client.metrics.engine_restarted()
            self.client.set_state(self.client.ready_state)

    async def _watch(self, engine: EngineProcess) -> None:
        """Return once `engine` is lost; declare it lost if it exits or stops making progress."""
        assert engine.pid is not None  # started
        liveness = Liveness(engine.pid, self.config.heartbeat_timeout, self.config.stall_timeout)
        while not engine.lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(engine.lost.wait(), WATCH_INTERVAL_S)
            if engine.lost.is_set():
                return
            if not engine.process.is_alive():
                self.client.lose(engine, f"the engine process exited ({engine.process.exitcode})")
                return
            now = time.monotonic()
            if self.client.busy:
                silent = now - engine.last_message
                if silent > self.config.stall_timeout:
                    self.client.lose(engine, f"no progress for {silent:.1f}s with work in flight")
                continue
            if liveness.probe_due(engine.last_message, now):
                engine.send(GetState())  # never refused: GetState is not bounded by the backlog
            if (reason := liveness.observe(engine.last_message, now)) is not None:
                self.client.lose(engine, reason)

    async def _restart(self) -> None:
        """Start engines until one is Ready and has replayed every applied update."""
        delay = self.config.restart_backoff
        while True:
            log.warning("engine.restarting", in_seconds=delay)
            await asyncio.sleep(delay)
            try:
                await self.client.launch()
                await asyncio.wait_for(self.client.replay(), self.config.ready_timeout)
                return
            except (EngineStartError, EngineUnavailableError, TimeoutError) as exc:
                # EngineUnavailableError: the new engine was lost before or during the replay.
                log.error("engine.restart_failed", error=str(exc) or type(exc).__name__)
            except Exception:  # spawning failed (an OS error) or a bug: logged, then retried
                log.exception("engine.restart_failed")
            engine = self.client.engine
            if engine is not None:
                self.client.lose(engine, "the restart failed")
                await engine.close(timeout=0)
            delay = min(max(delay * 2, 0.1), self.config.restart_backoff_max)


def log_task_failure(task: asyncio.Task[None]) -> None:
    """The supervisor's task's done callback: its failure is logged, never left unobserved."""
    if not task.cancelled() and task.exception() is not None:
        log.error("engine.supervisor_failed", exc_info=task.exception())
