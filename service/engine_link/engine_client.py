"""EngineClient: the service's one handle on the engine, whichever process currently runs it.

It owns the facts the rest of the service reads: the engine's state, the served policy version
(`policy_version`, which never goes backwards), whether a weight update is in progress
(`updating_weights`, the one update slot), the sleep level (`sleep_link`), the LoRA adapters
(`adapters`), the last stats. Requests go to the engine through `submit` and come back through
the RequestRouter; weight updates through `update_weights`; Sleep and Wake through
`sleep_or_wake`. The engine process is an EngineProcess; the Supervisor replaces a lost one and
replays the ReplayLog and adapters into the new one (asleep if the server sleeps) first.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import structlog

from engine.process import engine_main
from engine.protocol.messages import (
    AbortRequests,
    AdapterOutcome,
    AddRequest,
    CacheFlushed,
    ConstraintChecked,
    EngineDead,
    EngineStats,
    FinishReason,
    FromEngine,
    Heartbeat,
    InflightPolicy,
    ModelInfo,
    Ready,
    Shutdown,
    Sleep,
    SleepOutcome,
    StepOutput,
    ToEngine,
    UpdateWeights,
    Wake,
    WeightsPhase,
    WeightsProgress,
    WeightTransferJoined,
)
from service.config import ServiceConfig
from service.engine_link.adapter_link import AdapterLink
from service.engine_link.checkpoint_fingerprint import checkpoint_fingerprint
from service.engine_link.engine_calls import EngineCalls
from service.engine_link.engine_process import (
    EngineProcess,
    EngineStartError,
    EngineTarget,
    EngineUnavailableError,
    StartProcess,
)
from service.engine_link.engine_state import SERVED, EngineState
from service.engine_link.kv_event_log import KvEventLog
from service.engine_link.replay import replay
from service.engine_link.replay_log import ReplayLog
from service.engine_link.routing import Inbox, RequestRouter
from service.engine_link.sleep_link import SleepLink
from service.engine_link.supervisor import Supervisor, log_task_failure
from service.engine_link.update_route import UpdateRoute, UpdateRoutes, deliver
from service.ops.metrics import Metrics

log = structlog.get_logger("sluice.engine_client")


class EngineClient:
    def __init__(
        self,
        config: ServiceConfig,
        metrics: Metrics,
        *,
        target: EngineTarget = engine_main,
        on_state: Callable[[EngineState], None] | None = None,
        start_process: StartProcess = BaseProcess.start,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.state = EngineState.STARTING
        self.info: ModelInfo | None = None
        self.stats = EngineStats()
        self.policy_version = config.engine.policy_version
        self.restarts = 0
        self.router = RequestRouter(config.stream_interval)
        self.replay_log = ReplayLog()
        self.sleep_link = SleepLink()
        # LoRA adapters: loads, answers, the replay
        self.adapters = AdapterLink(
            self._send, config.engine.max_lora_rank, metrics.adapter_quarantined
        )
        self.engine: EngineProcess | None = None
        self._target = target
        self._start_process = start_process
        self._on_state = on_state
        self._updates = UpdateRoutes()
        self.calls = EngineCalls(self._send)  # transfer joins, constraint checks, flushes, stats
        self.kv_events = KvEventLog()  # the prefix cache's events, for SubscribeKvEvents
        self.awaiting_weights = False  # restarted without weights it could not replay
        self._supervisor: asyncio.Task[None] | None = None

    # ---- lifecycle ----

    async def start(self) -> ModelInfo:
        """Spawn the engine and wait for Ready; then supervise it in the background."""
        info = await self.launch()
        self.policy_version = info.policy_version
        self.set_state(EngineState.SERVING)
        self._supervisor = asyncio.create_task(Supervisor(self).run(), name="engine-supervisor")
        self._supervisor.add_done_callback(log_task_failure)
        return info

    async def shutdown(self, timeout: float) -> None:
        """Ask the engine to abort what is left (ABORTED outputs reach the handlers) and exit;
        kill it after `timeout` seconds. Deletes the replay log's files and adapter spools."""
        self.set_state(EngineState.STOPPING)
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        engine = self.engine
        if engine is not None:
            with contextlib.suppress(EngineUnavailableError):
                self._send(Shutdown())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(engine.lost.wait(), timeout)
            self.lose(engine, "the server is shutting down")
            await engine.close(timeout=0)
        self.replay_log.clear()
        self.adapters.delete_spools()
        self.set_state(EngineState.STOPPED)

    @property
    def stopping(self) -> bool:
        return self.state in (EngineState.STOPPING, EngineState.STOPPED)

    @property
    def busy(self) -> bool:
        """Requests, updates, joins, checks, Sleep, Wake or adapter calls await progress."""
        return bool(
            len(self.router)
            or len(self._updates)
            or self.calls.busy
            or self.sleep_link.busy
            or self.adapters.busy
        )

    @property
    def ready_state(self) -> EngineState:
        """The state of an engine that is up: SLEEPING while the server sleeps, else
        AWAITING_WEIGHTS while weights that cannot be replayed are missing, else SERVING."""
        if self.sleep_link.level:
            return EngineState.SLEEPING
        return EngineState.AWAITING_WEIGHTS if self.awaiting_weights else EngineState.SERVING

    # ---- requests ----

    def has(self, request_id: str) -> bool:
        return request_id in self.router

    @property
    def in_flight(self) -> int:
        return len(self.router)

    @property
    def waiting(self) -> int:
        """Admitted requests the engine has not produced anything for yet."""
        return self.router.waiting

    def submit(self, request: AddRequest) -> Inbox:
        """Send a request to the engine; its outputs arrive in the returned Inbox.

        The caller has checked `has(request.request_id)` is False. The last output of every
        index has `finish_reason` set (ERROR with a message if the engine is lost). Raises
        EngineUnavailableError when the engine cannot take it now.
        """
        self._send(request)
        return self.router.add(request.request_id, request.n)

    def abort(self, request_ids: list[str], reason: FinishReason, index: int | None = None) -> None:
        """Abort in the engine (only sample `index` when given); each aborted sample's final
        output (with `reason`) follows as usual."""
        ids = [rid for rid in request_ids if rid in self.router]
        if ids:
            with contextlib.suppress(EngineUnavailableError):
                self._send(AbortRequests(ids, reason, index))

    def detach(self, request_id: str) -> None:
        """The handler stopped listening; outputs are dropped from now on."""
        self.router.detach(request_id)

    # ---- weight updates ----

    @property
    def updating_weights(self) -> bool:
        """A weight update holds the slot: being received, or applied by the engine."""
        return self._updates.claimed

    def claim_update(self) -> None:
        """Take the one weight-update slot; UpdateInProgressError if it is taken. It is freed
        by the update's final message, or by `release_update` if the update is never sent."""
        self._updates.claim()

    def release_update(self) -> None:
        self._updates.release()

    def update_weights(
        self,
        update: UpdateWeights,
        on_final: Callable[[WeightsProgress], None] | None = None,
    ) -> asyncio.Queue[WeightsProgress]:
        """Send a weight update (the caller holds the slot); its progress arrives on the
        returned queue, ending with one final message (APPLIED, or FAILED with a gRPC status
        name in `error_code`; UNAVAILABLE if the engine is lost meanwhile). `on_final` runs on
        the event loop when that final message is routed, also when nobody reads the queue
        any more; the slot is free by then. Raises EngineUnavailableError if the engine cannot
        take it now (the caller still holds the slot)."""
        assert self._updates.claimed, "claim_update() first"
        route = self._send_update(update, on_final, replay=False)
        if update.checkpoint_dir is not None:  # before the engine reads it: what it will read
            route.fingerprint = checkpoint_fingerprint(update.checkpoint_dir)
        return route.queue

    def _send_update(
        self,
        update: UpdateWeights,
        on_final: Callable[[WeightsProgress], None] | None,
        replay: bool,
    ) -> UpdateRoute:
        self._send(update)
        return self._updates.add(update, on_final, replay, self._progress)

    async def replay(self) -> None:
        """Re-apply the replay log to a freshly started engine (service/engine_link/replay.py);
        a server that slept when the engine was lost puts the new one back to sleep."""
        self.awaiting_weights = await replay(self, self.replay_log)
        await self.adapters.replay()
        if level := self.sleep_link.level:
            self._send(Sleep(f"resleep-{self.restarts}", level, InflightPolicy.ABORT))
            log.info("engine.put_back_to_sleep", level=level)

    def send_replay(self, update: UpdateWeights) -> asyncio.Queue[WeightsProgress]:
        """Send one update of the replay log: it changes neither the version nor the log."""
        return self._send_update(update, None, replay=True).queue

    def _progress(self, route: UpdateRoute, progress: WeightsProgress) -> None:
        # Published at once: a caller that saw Applied may ask for min_policy_version = the
        # new one, or start the next update.
        if progress.phase is WeightsPhase.APPLIED and not route.replay:
            self.policy_version = progress.policy_version
            self.replay_log.record(
                route.update, progress.policy_version, route.fingerprint, progress.replaced_all
            )
            if self.awaiting_weights and progress.replaced_all:
                self.awaiting_weights = False
                self.set_state(self.ready_state)  # SLEEPING if it sleeps meanwhile
        deliver(route, progress)

    # ---- sleep and wake ----

    async def sleep_or_wake(self, msg: Sleep | Wake) -> SleepOutcome:
        """Send a Sleep or a Wake (the caller checked nothing else is in progress) and wait
        for its answer (UNAVAILABLE if the engine is lost meanwhile). From a Sleep's sending
        the state is SLEEPING: new requests are refused while it drains. The answer sets the
        state, also when nobody awaits it any more. Raises EngineUnavailableError if the
        engine cannot take it now."""
        answer = self.sleep_link.expect(msg.sleep_id)
        try:
            self._send(msg)
        except EngineUnavailableError:
            self.sleep_link.forget(msg.sleep_id)
            raise
        if isinstance(msg, Sleep):
            self.set_state(EngineState.SLEEPING)
        return await asyncio.shield(answer)

    def _route_sleep(self, outcome: SleepOutcome) -> None:
        if not self.sleep_link.route(outcome):
            return  # a restarted engine put back to sleep: replay() awaits nothing here
        if self.state in (EngineState.SERVING, EngineState.SLEEPING):
            self.set_state(self.ready_state)

    # ---- stats ----

    async def refresh_stats(self, timeout: float = 1.0) -> EngineStats:
        """Ask for fresh stats; fall back to the last known ones after `timeout`."""
        with contextlib.suppress(EngineUnavailableError):
            await self.calls.fresh_stats(timeout)
        return self.stats

    def _update_stats(self, msg: StepOutput | Heartbeat) -> None:
        self.stats = msg.stats
        self.metrics.engine_stats(msg.stats)
        self.calls.stats_arrived()
        self.kv_events.add(msg.kv_events)

    # ---- the engine process ----

    async def launch(self) -> ModelInfo:
        """Start a new engine process and wait for its Ready; EngineStartError if it dies or
        times out first (it is killed then)."""
        self.metrics.engine_started()
        engine = EngineProcess(
            self.config.engine,
            self._target,
            on_messages=self._dispatch,
            on_lost=self.lose,
            max_backlog_bytes=self.config.max_pipe_backlog_bytes,
            start_process=self._start_process,
        )
        self.engine = engine
        log.info("engine.spawned", engine_pid=engine.pid, model=self.config.engine.model)
        try:
            info = await asyncio.wait_for(asyncio.shield(engine.ready), self.config.ready_timeout)
        except (TimeoutError, EngineStartError) as exc:
            self.lose(engine, f"no Ready: {exc or 'timed out'}")
            await engine.close(timeout=0)
            raise EngineStartError(str(exc) or "timed out waiting for Ready") from exc
        except asyncio.CancelledError:
            self.lose(engine, "the launch was cancelled")
            await engine.close(timeout=0)
            raise
        log.info("engine.ready", model=info.model, path=info.path, total_pages=info.total_pages)
        return info

    def lose(self, engine: EngineProcess, reason: str) -> None:
        """`engine` is gone (or must be given up): end every in-flight request with ERROR and
        fail every pending update. Idempotent; the Supervisor then restarts it."""
        if engine.lost.is_set():
            return
        engine.lost.set()
        if not engine.ready.done():
            engine.ready.set_exception(EngineStartError(reason))
            engine.ready.exception()  # observed: nobody waits for it when the server stops early
        if engine is not self.engine:
            return  # a replaced incarnation: what it carried was failed when it was replaced
        if self.state in SERVED:  # now: a request admitted before the Supervisor wakes is refused
            self.set_state(EngineState.RESTARTING)
        self.stats = EngineStats()  # nothing runs or waits in a lost engine
        if not self.stopping:
            log.error("engine.lost", reason=reason, in_flight=len(self.router))
        message = f"the engine failed: {reason}"
        self.router.fail_all(message, self.policy_version)
        self._updates.fail_all(message)
        self.sleep_link.fail_all(message)
        self.calls.fail_all(message)
        self.adapters.fail_all(message)

    def _send(self, msg: ToEngine) -> None:
        engine = self.engine
        if engine is None or engine.lost.is_set():
            raise EngineUnavailableError(f"the engine is {self.state.value}")
        engine.send(msg)

    def _dispatch(self, engine: EngineProcess, batch: list[FromEngine]) -> None:
        for msg in batch:
            if engine.lost.is_set():
                return
            match msg:
                case StepOutput():
                    self._update_stats(msg)
                    for output in msg.all_outputs():  # the columns' rows built here
                        if self.router.route(output):
                            self.metrics.request_started(output.prompt_tokens)
                        if output.metrics is not None:
                            self.metrics.request_ended(output)
                case Heartbeat():
                    self._update_stats(msg)
                case WeightsProgress() as progress:
                    if not self._updates.route(progress):
                        log.error("engine.unknown_update", update_id=progress.update_id)
                case SleepOutcome() as outcome:
                    self._route_sleep(outcome)
                case WeightTransferJoined() as joined:
                    if not self.calls.joins.route(joined.transfer_id, joined):
                        log.error("engine.unknown_transfer", transfer_id=joined.transfer_id)
                case ConstraintChecked() | CacheFlushed():
                    self.calls.route(msg)
                case AdapterOutcome() as outcome:
                    self.adapters.route(outcome)
                case Ready(info=info):
                    self.info = info
                    if not engine.ready.done():
                        engine.ready.set_result(info)
                case EngineDead(reason=reason, traceback=tb):
                    log.error("engine.dead", reason=reason, traceback=tb)
                    self.lose(engine, reason)
                case _:
                    log.error("engine.unexpected_message", type=type(msg).__name__)

    def set_state(self, state: EngineState) -> None:
        if state is self.state:
            return
        log.info("engine.state", state=state.value)
        self.state = state
        if self._on_state is not None:
            self._on_state(state)
