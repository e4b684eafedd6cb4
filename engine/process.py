"""The engine process: LLMEngine behind one duplex pipe.

Started by the service with the 'spawn' context as `engine_main(config, conn)`. The loop:
1. drain the pipe (block only when idle, until a message or a compiled grammar), 2. step,
3. publish one StepOutput per step (and the answers of constraints checked meanwhile).
Adapter messages (LoadAdapter, UnloadAdapter, ListAdapters) and FlushCache are answered as they
are drained. The prefix cache records its events from the start of the loop (the warm-up's are
not sent: the cache is empty after it, and the first event of every engine is an
AllBlocksCleared); each StepOutput and Heartbeat carries those recorded since the last.
This module imports torch only inside `engine_main`, so the service can name it as a target.

The service declares the engine hung when nothing arrives for its stall timeout while work is
in flight, so the engine is never silent for long: every loop iteration sends something (a
StepOutput for each step, a Heartbeat when idle, at least every HEARTBEAT_INTERVAL_S), and a
weight update's progress goes down the pipe while its tensors load, not after.
NOTE: one step (a forward of at most max_num_batched_tokens), the staging of one tensor and a
Wake (which reloads every weight after a level-2 sleep) must each fit in the stall timeout;
nothing is sent in the middle of any of them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

import structlog

from engine.logs import configure_logging
from engine.parent_death import die_with_parent
from engine.protocol.config import EngineConfig
from engine.protocol.error_code import ErrorCode
from engine.protocol.kv_events import AllBlocksCleared
from engine.protocol.messages import (
    AbandonCheck,
    AbortRequests,
    AdapterOutcome,
    AdapterState,
    AddRequest,
    CacheFlushed,
    CheckConstraint,
    EngineDead,
    EngineStats,
    FinishReason,
    FlushCache,
    GetState,
    Heartbeat,
    InitWeightTransfer,
    ListAdapters,
    LoadAdapter,
    Ready,
    RequestOutput,
    Shutdown,
    Sleep,
    StepOutput,
    ToEngine,
    UnloadAdapter,
    UpdateWeights,
    Wake,
)

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine
    from engine.protocol.kv_events import KvEvent

HEARTBEAT_INTERVAL_S = 1.0

log = structlog.get_logger("sluice.engine")


def engine_main(config: EngineConfig, conn: Connection) -> None:
    """Process entry point: load the model, announce Ready, serve until Shutdown or EOF.

    Any exception ends the process with exit status 1, after an EngineDead to the service and
    one `engine.crashed` log line that carries the traceback.
    """
    # Before anything can log: the engine's lines share the service's stderr and its format.
    configure_logging(config.log_level, config.log_format, process="engine")
    # Ctrl-C at a terminal signals the whole process group: the service drains and then stops
    # this process with Shutdown; the engine must not die of the same SIGINT meanwhile.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    try:
        import torch

        from engine.core.llm_engine import LLMEngine

        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        started = time.monotonic()
        engine = LLMEngine(config)
        info = engine.info
        log.info(
            "engine.loaded",
            model=info.model,
            device=info.device,
            dtype=info.dtype,
            total_pages=info.total_pages,
            cpu_threads=torch.get_num_threads(),
            seconds=round(time.monotonic() - started, 3),
            warmup_seconds=None if engine.warmup is None else round(engine.warmup["seconds"], 3),
        )
        conn.send(Ready(info))
        try:
            _serve(engine, conn)
        finally:
            engine.close()  # tensor-parallel workers stop with us (they would die anyway)
    except (EOFError, BrokenPipeError):
        log.info("engine.exiting", reason="the service closed the pipe")
        return  # nobody is left to tell
    except BaseException as exc:  # the last message of a dying engine, then die loudly
        reason = f"{type(exc).__name__}: {exc}"
        # Logged first: once told, the service may kill this process at any moment.
        log.critical("engine.crashed", reason=reason, exc_info=exc)
        with contextlib.suppress(OSError, EOFError):
            conn.send(EngineDead(reason=reason, traceback=traceback.format_exc()))
        # NOTE: not re-raised: multiprocessing would print it again, as raw traceback lines.
        raise SystemExit(1) from None
    log.info("engine.exiting", reason="shutdown")


def _serve(engine: LLMEngine, conn: Connection) -> None:
    # Weight-update progress is sent as it happens (throttled by the engine), also from
    # inside a long staging; a swap at a step's start is announced before that step's tokens.
    engine.updater.sink = conn.send
    engine.sleeper.sink = conn.send  # one SleepOutcome per Sleep or Wake
    # A grammar compiled (on its own thread) wakes an idle loop: a request or a check waits.
    # (Locked: a grammar that compiled before its callback was added calls it on this thread.)
    woken, wake = multiprocessing.Pipe(duplex=False)
    wake_lock = threading.Lock()

    def on_done() -> None:
        with wake_lock:
            wake.send_bytes(b"")

    engine.structured.grammars.on_done = on_done
    engine.updater.transfer.on_done = on_done  # a weight-transfer join settled: answer it
    if engine.cache.enabled:  # a new engine's cache holds nothing: say so first
        engine.cache.events = [AllBlocksCleared()]
    while True:
        # 1. Drain every waiting message; block (up to a heartbeat, or a join's deadline)
        # only when idle.
        wait([conn, woken], 0.0 if engine.can_step() else _idle_wait(engine))
        while woken.poll():
            woken.recv_bytes()
        while conn.poll():
            msg: ToEngine = conn.recv()
            if isinstance(msg, Shutdown):
                engine.abort_all(FinishReason.ABORTED, "the server is shutting down")
                conn.send(step_message(engine.step(), engine.stats(), engine.cache.take_events()))
                return
            _handle(engine, conn, msg)
        for verdict in engine.structured.verdicts():
            conn.send(verdict)
        joined = engine.settle_weight_transfer()
        if joined is not None:
            conn.send(joined)
        if not engine.can_step():
            conn.send(Heartbeat(engine.stats(), engine.cache.take_events()))
            continue
        # 2. Step, 3. publish: one StepOutput per step, even an empty one (it is also the
        # engine's sign of life while it works).
        outputs = engine.step()
        conn.send(step_message(outputs, engine.stats(), engine.cache.take_events()))


def _idle_wait(engine: LLMEngine) -> float:
    due = engine.updater.join_due_in()
    return HEARTBEAT_INTERVAL_S if due is None else min(HEARTBEAT_INTERVAL_S, due)


def step_message(
    outputs: Sequence[RequestOutput], stats: EngineStats, kv_events: list[KvEvent] | None = None
) -> StepOutput:
    """A step's outputs for the pipe: the plain rows as columns (TokenColumns) when the step
    ran a forward, which costs the engine a tenth of pickling an object per row."""
    from engine.core.output_columns import OutputColumns  # engine-side only: not a shared module

    if isinstance(outputs, OutputColumns):
        objects, columns = outputs.for_pipe()
        return StepOutput(objects, stats, columns, kv_events)
    return StepOutput(list(outputs), stats, None, kv_events)


def _handle(engine: LLMEngine, conn: Connection, msg: ToEngine) -> None:
    match msg:
        case AddRequest():
            engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                msg.params,
                n=msg.n,
                priority=msg.priority,
                deadline=msg.deadline,
                min_policy_version=msg.min_policy_version,
            )
        case AbortRequests():
            engine.abort(msg.request_ids, msg.reason, index=msg.index)
        case UpdateWeights():
            engine.start_weight_update(msg)
        case Sleep():
            engine.start_sleep(msg)
        case Wake():
            engine.wake(msg)
        case CheckConstraint():
            engine.structured.check(msg.check_id, msg.constraint, msg.caller)
        case AbandonCheck():
            engine.structured.abandon_check(msg.check_id)
        case InitWeightTransfer():
            # The group forms on threads beside the loop; the loop answers once it settles.
            answer = engine.begin_weight_transfer(msg)
            if answer is not None:
                conn.send(answer)
        case GetState():
            conn.send(Heartbeat(engine.stats(), engine.cache.take_events()))
        case FlushCache():
            freed = engine.flush_cache()
            # Its AllBlocksCleared first: once FlushCache is answered, the service has it.
            conn.send(Heartbeat(engine.stats(), engine.cache.take_events()))
            conn.send(CacheFlushed(msg.flush_id, freed))
        case LoadAdapter() | UnloadAdapter() | ListAdapters():
            # NOTE: a load reads the adapter's file in the loop (megabytes: well within the
            # stall timeout); running requests are not disturbed.
            conn.send(adapter_outcome(engine, msg))
        case _:
            raise TypeError(f"unexpected message on the engine pipe: {type(msg).__name__}")


def adapter_outcome(
    engine: LLMEngine, msg: LoadAdapter | UnloadAdapter | ListAdapters
) -> AdapterOutcome:
    """Do what `msg` asks of the engine's adapters; the answer, with the adapters loaded after
    it. A failure changes nothing and names its gRPC status here, the one place that does."""
    from safetensors import SafetensorError  # a corrupt adapter file: the caller's mistake

    from engine.lora.adapter_update import AdapterUpdateError

    error_code: ErrorCode | None = None
    message = ""
    try:
        match msg:
            case LoadAdapter(replace=True):
                engine.replace_adapter(msg.name, msg.path, msg.policy_version, msg.inflight)
            case LoadAdapter():
                engine.load_adapter(msg.name, msg.path, msg.pinned, msg.policy_version or 1)
            case UnloadAdapter():
                engine.unload_adapter(msg.name)
    except AdapterUpdateError as exc:
        error_code, message = exc.code, str(exc)
    except (ValueError, OSError, SafetensorError) as exc:
        error_code, message = _adapter_error(engine, msg), str(exc)
    registry = engine.lora
    adapters = tuple(
        AdapterState(
            a.name,
            a.path,
            a.rank,
            a.scaling,
            a.target_modules,
            a.pinned,
            a.key in registry.slot_of_key,
            a.version,
        )
        for a in engine.adapters()
    )
    return AdapterOutcome(msg.action_id, adapters, error_code, message)


def _adapter_error(engine: LLMEngine, msg: LoadAdapter | UnloadAdapter | ListAdapters) -> ErrorCode:
    """The status of a failed adapter action, judged on the unchanged registry."""
    registry = engine.lora
    if isinstance(msg, UnloadAdapter):
        return (
            ErrorCode.NOT_FOUND
            if msg.name not in registry.loaded
            else ErrorCode.FAILED_PRECONDITION
        )
    assert isinstance(msg, LoadAdapter)
    pinned = sum(a.pinned for a in registry.loaded.values())
    if msg.name and msg.name in registry.loaded and not msg.replace:
        return ErrorCode.ALREADY_EXISTS
    if not registry.max_loras or (msg.pinned and pinned + 1 >= registry.max_loras):
        return ErrorCode.FAILED_PRECONDITION  # the engine's capacity, not the adapter
    return ErrorCode.INVALID_ARGUMENT
