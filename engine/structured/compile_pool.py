"""CompilePool: constraints compiled in worker processes, each compile bounded and killable.

`workers` slots, each a thread of the engine process that owns one compile worker
(compile_worker.py) and feeds it jobs from a CompileQueue (fair between callers). A compile
that runs past `timeout_s`, or needs more than `memory_bytes` of address space, fails with a
ConstraintError naming the field (INVALID_ARGUMENT); one whose waiters all left is abandoned:
dropped if it was still queued, its worker killed if it was running. A killed worker is
replaced before its slot (and its caller) takes another job, so the cost of a kill falls on
the caller that caused it. The engine's loop only queues and abandons: it never waits here.

A worker only proves that a constraint compiles within the bounds; the slot's thread then
compiles it again in the engine, which the proof bounds. Sending the compiled grammar back
would cost more than compiling twice: xgrammar's JSON of a 200-property schema that compiles in
0.04 s is 53 MB and takes 1.8 s to write (a 320-token vocabulary), and that of a 1,000-rule
grammar that compiles in 1 s is 140 MB and 5 s.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import structlog

from engine.parent_death import children_allowed
from engine.protocol.config import EngineConfig
from engine.protocol.messages import Constraint
from engine.structured.compile_queue import CompileJob, CompileQueue
from engine.structured.compile_worker import READY, worker_main
from engine.structured.constraint_error import ConstraintError

log = structlog.get_logger("sluice.engine")

START_TIMEOUT_S = 120.0  # a worker's start-up: imports xgrammar, reads the vocabulary
SLOW_COMPILE_S = 1.0  # a compile still running after this long is logged (once)
STOP_TIMEOUT_S = 5.0  # close: each slot's thread kills its worker and ends
_spawn_lock = threading.Lock()  # children_allowed flips a process-wide flag


@dataclass(frozen=True)
class CompileLimits:
    """How compiles run: `workers` processes; each compile at most `timeout_s` seconds and
    `memory_bytes` of address space beyond what a worker holds after start-up."""

    workers: int = 2
    timeout_s: float = 10.0
    memory_bytes: int = 2 << 30

    @classmethod
    def of(cls, config: EngineConfig) -> CompileLimits:
        return cls(
            config.grammar_compile_workers,
            config.grammar_compile_timeout,
            config.grammar_compile_memory,
        )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("grammar_compile_workers: must be at least 1")
        if not self.timeout_s > 0:
            raise ValueError("grammar_compile_timeout: must be positive")
        if self.memory_bytes < 1 << 20:
            raise ValueError("grammar_compile_memory: must be at least 1 MiB")


class CompilePool:
    def __init__(
        self,
        limits: CompileLimits,
        tokenizer_info: Callable[[], Any],
        compile_with: Callable[[Any, Constraint], Any],
    ) -> None:
        """`tokenizer_info` makes the engine's xgrammar TokenizerInfo (called once, on a slot's
        thread: it imports xgrammar and reads the vocabulary); `compile_with(compiler,
        constraint)` compiles in the workers (a module-level function: it is pickled by name)."""
        self.limits = limits
        self.compile_with = compile_with
        self.queue = CompileQueue()
        self._make_info = tokenizer_info
        self._info: Any = None
        self._info_json = ""
        self._info_lock = threading.Lock()
        self.slots = [_Slot(self, i) for i in range(limits.workers)]
        for slot in self.slots:
            slot.thread.start()

    def submit(self, constraint: Constraint, caller: str) -> CompileJob:
        job = CompileJob(constraint, caller)
        self.queue.put(job)
        return job

    def abandon(self, job: CompileJob) -> None:
        """Nobody waits for `job` any more: cancel it, queued or running (its worker killed).
        Never blocks on a compile."""
        with self.queue.lock:
            if job.settled:
                return
            job.abandoned = True
            queued = self.queue.remove(job)
            if not queued and job.slot is not None:
                self.slots[job.slot].wake()
        if queued:
            _cancel(job)

    def wait_started(self, timeout: float) -> bool:
        """Every worker has started (or failed to) once; False if not within `timeout` s."""
        end = time.monotonic() + timeout
        return all(slot.started.wait(max(0.0, end - time.monotonic())) for slot in self.slots)

    def close(self) -> None:
        self.queue.close()
        for slot in self.slots:
            slot.stop()
        for slot in self.slots:
            slot.thread.join(STOP_TIMEOUT_S)

    def tokenizer_info(self) -> tuple[Any, str]:
        """The engine's TokenizerInfo and its JSON (made on first use)."""
        with self._info_lock:
            if self._info is None:
                self._info = self._make_info()
                self._info_json = self._info.serialize_json()
            return self._info, self._info_json


class _Slot:
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: CompilePool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.process: Any = None
        self.conn: Connection | None = None
        self.compiler: Any = None  # xgrammar.GrammarCompiler of this slot, made at first use
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._stopping = False
        self.started = threading.Event()  # its first worker started (or failed to)
        self.thread = threading.Thread(
            target=self._run, name=f"sluice-grammar-{index}", daemon=True
        )

    def wake(self) -> None:
        self._wake_w.send_bytes(b"")

    def stop(self) -> None:
        """Have the thread kill its worker (at once, also mid-compile) and end."""
        self._stopping = True
        self.wake()

    def _run(self) -> None:
        # NOTE: this thread starts the worker and must outlive it: the worker dies with it
        # (die_with_parent fires when the thread that started a process ends).
        queue = self.pool.queue
        self._restart()  # at once, not at the first job: a start takes seconds
        self.started.set()
        while (job := queue.take(self.index)) is not None:
            try:
                self._settle(job, *self._compile(job))
            except Exception as exc:  # the worker cannot start: no constraint compiles
                self._kill()
                self._settle(job, None, exc)
            finally:
                # A killed worker is replaced before the caller may compile again: the cost
                # of the kill falls on the caller whose compile caused it.
                if self.conn is None and not self._stopping:
                    self._restart()
                queue.finish(job)
        self._kill()

    def _restart(self) -> None:
        try:
            self._start()
        except Exception as exc:  # the next job tries again, and fails with the reason
            self._kill()
            if not self._stopping:  # a start cut short by close() is no failure
                log.error("engine.grammar_worker_failed", error=repr(exc))

    def _compile(self, job: CompileJob) -> tuple[Any, BaseException | None]:
        """(compiled grammar, None), or (None, why not). A compile past the time limit, or
        abandoned, kills the worker at once."""
        if self.conn is None:
            self._start()
        while self._wake_r.poll():  # wakes meant for earlier jobs
            self._wake_r.recv_bytes()
        if self.conn is None or job.abandoned:  # closed, or abandoned while its worker started
            return None, RuntimeError("the engine is shutting down")  # abandoned: cancelled
        self.conn.send(job.constraint)
        limit = self.pool.limits.timeout_s
        deadline = time.monotonic() + limit
        slow_at: float | None = time.monotonic() + SLOW_COMPILE_S
        while True:
            now = time.monotonic()
            if slow_at is not None and now >= slow_at:
                log.info(
                    "engine.grammar_compile_slow", field=job.constraint.field, caller=job.caller
                )
                slow_at = None
            if now >= deadline:
                self._kill_for(job, "timeout")
                why = f"too costly to compile: not compiled within {limit:g} s"
                return None, ConstraintError(f"{job.constraint.field}: {why}")
            until = deadline if slow_at is None else min(deadline, slow_at)
            ready = wait([self.conn, self.process.sentinel, self._wake_r], until - now)
            outcome = self._outcome(job, ready)
            if outcome is not None:
                return outcome

    def _outcome(
        self, job: CompileJob, ready: list[Any]
    ) -> tuple[Any, BaseException | None] | None:
        """What the ready connections tell of the job: its outcome, or None (still running)."""
        assert self.conn is not None
        field = job.constraint.field
        if self.conn in ready:
            try:
                status, payload = self.conn.recv()
            except EOFError:
                ready = [self.process.sentinel]
            else:
                if status == "ok":
                    return self._compile_here(job)
                if status == "memory":
                    self._kill_for(job, "memory")
                return None, ConstraintError(payload)
        if self.process.sentinel in ready:
            self.process.join()
            code = self.process.exitcode
            self._kill_for(job, f"exit code {code}")
            limit = f"{self.pool.limits.memory_bytes >> 20} MiB"
            why = f"too costly to compile: the compiler ended (exit code {code}; limit {limit})"
            return None, ConstraintError(f"{field}: {why}")
        if self._wake_r in ready and (job.abandoned or self._stopping):
            self._kill_for(job, "abandoned" if job.abandoned else "shutdown")
            return None, RuntimeError("the engine is shutting down")  # abandoned: cancelled
        return None

    def _compile_here(self, job: CompileJob) -> tuple[Any, BaseException | None]:
        """The job compiled in the engine, on this thread, once its worker has compiled it
        within the bounds (so this one is bounded too; it cannot be interrupted)."""
        if self.compiler is None:
            import xgrammar

            info, _ = self.pool.tokenizer_info()
            threads = min(4, os.cpu_count() or 1)
            self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        try:
            return self.pool.compile_with(self.compiler, job.constraint), None
        except ConstraintError as exc:
            return None, exc

    def _settle(self, job: CompileJob, grammar: Any, error: BaseException | None) -> None:
        with self.pool.queue.lock:
            job.settled = True
            cancel = job.abandoned
        # NOTE: outside the lock: the future's callbacks wake the engine's loop, which may be
        # waiting for this lock in `abandon`.
        if cancel:
            _cancel(job)
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(grammar)

    def _start(self) -> None:
        _, info_json = self.pool.tokenizer_info()
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        limits = self.pool.limits
        threads = min(4, os.cpu_count() or 1)
        with _spawn_lock, children_allowed():
            process = ctx.Process(
                target=worker_main,
                args=(child, self.pool.compile_with, limits.memory_bytes, threads),
                name=f"sluice-grammar-{self.index}",
                daemon=True,
            )
            process.start()
        child.close()
        self.process, self.conn = process, conn
        started = time.monotonic()
        if self._ready(conn, process, info_json, started + START_TIMEOUT_S):
            seconds = round(time.monotonic() - started, 3)
            log.info("engine.grammar_worker_started", worker_pid=process.pid, seconds=seconds)
        elif self._stopping:  # closed while it started: no worker, and no error
            self._kill()
        else:
            raise RuntimeError(f"the grammar compile worker did not start ({process.exitcode})")

    def _ready(self, conn: Connection, process: Any, info_json: str, deadline: float) -> bool:
        """The new worker, sent the TokenizerInfo, said READY before `deadline` (False: it
        died, or the pool closes). A worker that dies before it reads the info resets the
        pipe (a socket pair): that is a worker that did not start, like one that exits."""
        try:
            conn.send(info_json)
        except OSError:
            return False
        while not self._stopping:
            watched = [conn, process.sentinel, self._wake_r]
            ready = wait(watched, max(0.0, deadline - time.monotonic()))
            if conn in ready:
                with contextlib.suppress(EOFError, OSError):
                    return bool(conn.recv() == READY)
                return False
            if process.sentinel in ready or not ready:
                return False
            self._wake_r.recv_bytes()  # an abandon: _compile looks at the job's flag itself
        return False

    def _kill_for(self, job: CompileJob, reason: str) -> None:
        field, pid = job.constraint.field, self.process.pid
        log.warning("engine.grammar_compile_killed", field=field, reason=reason, worker_pid=pid)
        self._kill()

    def _kill(self) -> None:
        process, conn = self.process, self.conn
        self.process = self.conn = None
        if process is not None:
            process.kill()
            process.join()
        if conn is not None:
            conn.close()


def _cancel(job: CompileJob) -> None:
    job.future.cancel()
    # NOTE: cancel() alone does not wake concurrent.futures.wait(); this does.
    job.future.set_running_or_notify_cancel()
