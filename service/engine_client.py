"""EngineClient: the service's side of the pipe to the engine process.

It spawns the engine (`spawn` context), waits for `Ready`, and runs one reader on the pipe's file
descriptor (`loop.add_reader`) that routes each StepOutput's RequestOutputs into per-request
asyncio queues, and each WeightsProgress into its weight update's queue (by update_id). It
supervises the engine: EngineDead, EOF, a dead process or no progress within the stall/heartbeat
timeout all mean the engine is lost; every in-flight request then receives a final ERROR output,
every pending weight update a final FAILED (UNAVAILABLE), and the engine is restarted with
bounded exponential backoff. A restarted engine loads the start-up checkpoint, so the weight
updates applied since (the last checkpoint update and the inline updates after it) are replayed
before it serves again: the policy version never goes backwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import structlog

from engine.config import EngineConfig
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineStats,
    FinishReason,
    GetState,
    Heartbeat,
    InflightPolicy,
    ModelInfo,
    Ready,
    RequestOutput,
    Shutdown,
    StepOutput,
    ToEngine,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
)
from engine.process import engine_main
from service.tensor_file import delete_file

log = structlog.get_logger("sluice.engine_client")

EngineTarget = Callable[[EngineConfig, Connection], None]
WATCH_INTERVAL_S = 0.5


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests now (starting, restarting or stopping)."""


class EngineStartError(RuntimeError):
    """The engine process died or timed out before announcing Ready."""


@dataclass
class _Route:
    """Where one request's outputs go, until the engine has finished every index of it."""

    queue: asyncio.Queue[RequestOutput]
    open_indices: set[int]
    started: bool = False
    # The handler is gone (client left, stop string matched): drop outputs, keep the id
    # reserved until the engine reports the request finished, so a reused id never receives
    # the old request's last output.
    detached: bool = False


@dataclass
class _UpdateRoute:
    """Where one weight update's progress goes, until its final message."""

    update: UpdateWeights
    queue: asyncio.Queue[WeightsProgress]
    on_final: Callable[[WeightsProgress], None] | None


@dataclass
class _Engine:
    """One incarnation of the engine process."""

    process: BaseProcess
    conn: Connection
    ready: asyncio.Future[ModelInfo]
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    last_message: float = field(default_factory=time.monotonic)


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        target: EngineTarget = engine_main,
        ready_timeout: float = 600.0,
        heartbeat_timeout: float = 15.0,
        stall_timeout: float = 120.0,
        restart_backoff: float = 0.5,
        restart_backoff_max: float = 30.0,
        on_state: Callable[[EngineState], None] | None = None,
    ) -> None:
        self.config = config
        self.state = EngineState.STARTING
        self.info: ModelInfo | None = None
        self.stats = EngineStats()
        self.restarts = 0
        self._target = target
        self._ready_timeout = ready_timeout
        self._heartbeat_timeout = heartbeat_timeout
        self._stall_timeout = stall_timeout
        self._backoff = restart_backoff
        self._backoff_max = restart_backoff_max
        self._on_state = on_state
        self._routes: dict[str, _Route] = {}
        self._updates: dict[str, _UpdateRoute] = {}
        # Applied updates a restarted engine must replay, oldest first. Owns their tensor files.
        self._replay: list[UpdateWeights] = []
        self._stats_waiters: list[asyncio.Future[None]] = []
        self._engine: _Engine | None = None
        self._supervisor: asyncio.Task[None] | None = None

    # ---- lifecycle ----

    async def start(self) -> ModelInfo:
        """Spawn the engine and wait for Ready; then supervise it in the background."""
        info = await self._launch()
        self._set_state(EngineState.SERVING)
        self._supervisor = asyncio.create_task(self._supervise(), name="engine-supervisor")
        self._supervisor.add_done_callback(_log_task_failure)
        return info

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the engine to abort what is left (ABORTED outputs reach the handlers) and exit."""
        self._set_state(EngineState.STOPPING)
        engine = self._engine
        if engine is not None:
            with contextlib.suppress(OSError, ValueError):
                engine.conn.send(Shutdown())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(engine.lost.wait(), timeout)
            await self._reap(engine)
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        self._set_state(EngineState.STOPPED)

    # ---- requests ----

    def has(self, request_id: str) -> bool:
        return request_id in self._routes

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    @property
    def waiting(self) -> int:
        """Admitted requests the engine has not produced anything for yet."""
        return sum(not route.started for route in self._routes.values())

    def submit(self, request: AddRequest) -> asyncio.Queue[RequestOutput]:
        """Send a request to the engine; its outputs arrive on the returned queue.

        The caller has checked `has(request.request_id)` is False. The last output of every
        index has `finish_reason` set (ERROR with a message if the engine is lost).
        """
        assert request.request_id not in self._routes, request.request_id
        self._send(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._routes[request.request_id] = _Route(queue, set(range(request.n)))
        return queue

    def abort(self, request_ids: list[str], reason: FinishReason, index: int | None = None) -> None:
        """Abort in the engine (only sample `index` when given); each aborted sample's final
        output (with `reason`) follows as usual."""
        ids = [rid for rid in request_ids if rid in self._routes]
        if ids:
            with contextlib.suppress(EngineUnavailableError):
                self._send(AbortRequests(ids, reason, index))

    def detach(self, request_id: str) -> None:
        """The handler stopped listening; outputs are dropped from now on."""
        route = self._routes.get(request_id)
        if route is not None:
            route.detached = True

    # ---- weight updates ----

    @property
    def updating_weights(self) -> bool:
        """A weight update is pending in the engine (sent, no final message yet)."""
        return bool(self._updates) or self.stats.updating_weights

    def update_weights(
        self,
        update: UpdateWeights,
        on_final: Callable[[WeightsProgress], None] | None = None,
    ) -> asyncio.Queue[WeightsProgress]:
        """Send a weight update; its progress arrives on the returned queue, ending with one
        final message (APPLIED, or FAILED with a gRPC status name in `error_code`; UNAVAILABLE
        if the engine is lost meanwhile). `on_final` runs (on the event loop, synchronously)
        when that final message is routed, also when nobody reads the queue any more.
        Raises EngineUnavailableError if the engine cannot take it now."""
        assert update.update_id not in self._updates, update.update_id
        self._send(update)
        queue: asyncio.Queue[WeightsProgress] = asyncio.Queue()
        self._updates[update.update_id] = _UpdateRoute(update, queue, on_final)
        return queue

    def _remember(self, update: UpdateWeights, version: int) -> None:
        """Keep an applied update for replay. A checkpoint replaces every tensor, so it
        supersedes (and frees the files of) everything applied before it."""
        if update.checkpoint_dir is not None:
            for old in self._replay:
                if old.tensor_file is not None:
                    delete_file(old.tensor_file)
            self._replay = []
        replay = replace(
            update, policy_version=version, inflight=InflightPolicy.CONTINUE, drain_timeout=None
        )
        self._replay.append(replay)

    async def _replay_updates(self) -> None:
        """Re-apply the remembered updates to a freshly started engine, in order."""
        for n, update in enumerate(self._replay):
            queue = self.update_weights(replace(update, update_id=f"replay-{self.restarts}-{n}"))
            while not (final := await queue.get()).final:
                pass
            if final.phase is WeightsPhase.FAILED:
                # NOTE: the engine now serves older weights, under their older version.
                log.error(
                    "engine.replay_failed",
                    policy_version=update.policy_version,
                    error=final.message,
                )
                return
            log.info("engine.replayed", policy_version=update.policy_version)

    def _route_progress(self, progress: WeightsProgress) -> None:
        route = self._updates.get(progress.update_id)
        if route is None:
            log.error("engine.unknown_update", update_id=progress.update_id)
            return
        if progress.final:
            # Published at once, before the engine's next stats arrive: a caller that saw
            # Applied may ask for min_policy_version = the new one, or start the next update.
            version = (
                progress.policy_version
                if progress.phase is WeightsPhase.APPLIED
                else self.stats.policy_version
            )
            self.stats = replace(self.stats, policy_version=version, updating_weights=False)
            del self._updates[progress.update_id]
            if progress.phase is WeightsPhase.APPLIED:
                self._remember(route.update, progress.policy_version)
        route.queue.put_nowait(progress)
        if progress.final and route.on_final is not None:
            route.on_final(progress)

    async def refresh_stats(self, timeout: float = 1.0) -> EngineStats:
        """Ask for fresh stats; fall back to the last known ones after `timeout`."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._send(GetState())
        except EngineUnavailableError:
            return self.stats
        self._stats_waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        return self.stats

    def _send(self, msg: ToEngine) -> None:
        engine = self._engine
        if engine is None or engine.lost.is_set():
            raise EngineUnavailableError(f"the engine is {self.state.value}")
        # NOTE: a blocking write; the engine drains its pipe every step, so a long prompt only
        # blocks the event loop for as long as one engine step.
        try:
            engine.conn.send(msg)
        except OSError as exc:
            self._lose(engine, f"pipe write failed: {exc}")
            raise EngineUnavailableError("the engine pipe is closed") from exc

    # ---- the reader: one per engine incarnation, on the event loop ----

    def _on_readable(self, engine: _Engine) -> None:
        try:
            while not engine.lost.is_set() and engine.conn.poll():
                msg = engine.conn.recv()
                engine.last_message = time.monotonic()
                self._dispatch(engine, msg)
        except (EOFError, OSError):
            self._lose(engine, "the engine process closed its pipe")

    def _dispatch(self, engine: _Engine, msg: object) -> None:
        match msg:
            case StepOutput(outputs=outputs, stats=stats):
                self._update_stats(stats)
                for output in outputs:
                    self._route(output)
            case Heartbeat(stats=stats):
                self._update_stats(stats)
            case WeightsProgress() as progress:
                self._route_progress(progress)
            case Ready(info=info):
                self.info = info
                self._update_stats(EngineStats(policy_version=info.policy_version))
                if not engine.ready.done():
                    engine.ready.set_result(info)
            case EngineDead(reason=reason, traceback=tb):
                log.error("engine.dead", reason=reason, traceback=tb)
                self._lose(engine, reason)
            case _:
                log.error("engine.unexpected_message", type=type(msg).__name__)

    def _route(self, output: RequestOutput) -> None:
        route = self._routes.get(output.request_id)
        if route is None:
            return  # already ended by an engine failure
        route.started = True
        if output.finished:
            route.open_indices.discard(output.index)
            if not route.open_indices:
                del self._routes[output.request_id]
        if not route.detached:
            route.queue.put_nowait(output)

    def _update_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        for waiter in self._stats_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._stats_waiters.clear()

    def _lose(self, engine: _Engine, reason: str) -> None:
        """The engine is gone: stop reading, end every in-flight request with ERROR."""
        if engine.lost.is_set():
            return
        engine.lost.set()
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(engine.conn.fileno())
        if not engine.ready.done():
            engine.ready.set_exception(EngineStartError(reason))
            engine.ready.exception()  # observed: nobody waits for it when the server stops early
        stopping = self.state in (EngineState.STOPPING, EngineState.STOPPED)
        if not stopping:
            log.error("engine.lost", reason=reason, in_flight=len(self._routes))
        message = f"the engine failed: {reason}"
        for request_id, route in self._routes.items():
            if route.detached:
                continue
            for index in sorted(route.open_indices):
                route.queue.put_nowait(
                    RequestOutput(
                        request_id,
                        index,
                        [],
                        self.stats.policy_version,
                        finish_reason=FinishReason.ERROR,
                        error=message,
                    )
                )
        self._routes.clear()
        self._fail_updates(message)

    def _fail_updates(self, message: str) -> None:
        updates, self._updates = self._updates, {}
        self.stats = replace(self.stats, updating_weights=False)
        for update_id, route in updates.items():
            failed = WeightsProgress(
                update_id, WeightsPhase.FAILED, error_code="UNAVAILABLE", message=message
            )
            route.queue.put_nowait(failed)
            if route.on_final is not None:
                route.on_final(failed)

    # ---- spawning and supervision ----

    async def _launch(self) -> ModelInfo:
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=self._target, args=(self.config, child_conn), name="sluice-engine", daemon=True
        )
        process.start()
        # NOTE: close the parent's copy of the child's end, or EOF never arrives when it dies.
        child_conn.close()
        engine = _Engine(process, parent_conn, loop.create_future())
        self._engine = engine
        loop.add_reader(parent_conn.fileno(), self._on_readable, engine)
        log.info("engine.spawned", pid=process.pid, model=self.config.model)
        try:
            info = await asyncio.wait_for(asyncio.shield(engine.ready), self._ready_timeout)
        except (TimeoutError, EngineStartError) as exc:
            self._lose(engine, f"no Ready: {exc or 'timed out'}")
            await self._reap(engine, kill=True)
            raise EngineStartError(str(exc) or "timed out waiting for Ready") from exc
        log.info("engine.ready", model=info.model, path=info.path, total_pages=info.total_pages)
        return info

    async def _supervise(self) -> None:
        while True:
            engine = self._engine
            assert engine is not None
            await self._watch(engine)
            if self.state in (EngineState.STOPPING, EngineState.STOPPED):
                return
            self._set_state(EngineState.RESTARTING)
            await self._reap(engine, kill=True)
            delay = self._backoff
            while True:
                log.warning("engine.restarting", in_seconds=delay)
                await asyncio.sleep(delay)
                try:
                    await self._launch()
                    await self._replay_updates()
                    break
                except EngineStartError as exc:
                    log.error("engine.restart_failed", error=str(exc))
                    delay = min(max(delay * 2, 0.1), self._backoff_max)
            self.restarts += 1
            self._set_state(EngineState.SERVING)

    async def _watch(self, engine: _Engine) -> None:
        """Return once the engine is lost (EOF, EngineDead, a dead process, or a stall)."""
        while not engine.lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(engine.lost.wait(), WATCH_INTERVAL_S)
            if engine.lost.is_set():
                return
            if not engine.process.is_alive():
                self._lose(engine, f"the engine process exited ({engine.process.exitcode})")
                return
            silent = time.monotonic() - engine.last_message
            busy = self._routes or self._updates
            limit = self._stall_timeout if busy else self._heartbeat_timeout
            if silent > limit:
                self._lose(engine, f"no progress for {silent:.1f}s")

    async def _reap(self, engine: _Engine, kill: bool = False) -> None:
        """Make sure the process is gone (kill it if it hangs) and close our end of the pipe."""
        if kill and engine.process.is_alive():
            engine.process.kill()  # a stalled engine would never exit by itself
        await asyncio.to_thread(engine.process.join, 5.0)
        if engine.process.is_alive():
            engine.process.kill()
            await asyncio.to_thread(engine.process.join, 5.0)
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(engine.conn.fileno())
        engine.conn.close()

    def _set_state(self, state: EngineState) -> None:
        if state is self.state:
            return
        log.info("engine.state", state=state.value)
        self.state = state
        if self._on_state is not None:
            self._on_state(state)


def _log_task_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("engine.supervisor_failed", exc_info=task.exception())
