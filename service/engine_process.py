"""EngineProcess: one incarnation of the engine process and the service's end of its pipe.

Neither direction of the pipe ever blocks the event loop. A writer thread sends what `send`
queues; a reader thread receives and hands each batch of messages to the loop
(`call_soon_threadsafe`). A stopped or hung engine therefore stalls only those threads: the loop
keeps answering health checks and runs the supervisor that will kill the engine. What waits for
the writer is bounded (`max_backlog_bytes`); past it `send` refuses new requests, so a request
that cannot be handed to the engine is answered at once instead of piling up.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler

from engine.config import EngineConfig
from engine.messages import AddRequest, FromEngine, ModelInfo, ToEngine, UpdateWeights

EngineTarget = Callable[[EngineConfig, Connection], None]
StartProcess = Callable[[BaseProcess], None]  # BaseProcess.start, or service.priority's
# Messages that carry caller payloads count against the backlog; control messages (abort,
# state, shutdown) always pass, so a cancel is never lost to a full queue.
BOUNDED_MESSAGES = (AddRequest, UpdateWeights)


class EngineUnavailableError(RuntimeError):
    """The engine cannot take this message now (starting, restarting, stopping, or backed up)."""


class EngineStartError(RuntimeError):
    """The engine process died or timed out before it was ready to serve."""


class EngineProcess:
    """Spawns the engine (`spawn` context) and runs the two pipe threads.

    `on_messages(self, batch)` runs on the event loop for every batch the reader thread
    received; `on_lost(self, reason)` runs there when either thread finds the pipe closed.
    `ready` and `lost` are the owner's to resolve and set (the owner decides what a message
    means). `start_process` starts the process (default: from the calling thread). `close()`
    ends the process (killing it if it hangs) before it joins the threads: only then can a
    writer stuck in a write to a stopped engine return.
    """

    def __init__(
        self,
        config: EngineConfig,
        target: EngineTarget,
        on_messages: Callable[[EngineProcess, list[FromEngine]], None],
        on_lost: Callable[[EngineProcess, str], None],
        max_backlog_bytes: int,
        start_process: StartProcess = BaseProcess.start,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=target, args=(config, child_conn), name="sluice-engine", daemon=True
        )
        # NOTE: from a thread that lives as long as the service (the event loop's, or the
        # Spawner's): the engine asks the kernel to kill it when that thread exits.
        start_process(self.process)
        # NOTE: close the parent's copy of the child's end, or EOF never arrives when it dies.
        child_conn.close()
        self.last_message = time.monotonic()
        self.ready: asyncio.Future[ModelInfo] = self._loop.create_future()
        self.lost = asyncio.Event()
        self._on_messages = on_messages
        self._on_lost = on_lost
        self._max_backlog = max_backlog_bytes
        self._backlog = 0  # bytes of bounded messages queued, not yet written
        self._backlog_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[bytes, bool] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, msg: ToEngine) -> None:
        """Queue `msg` for the engine; never blocks. Raises EngineUnavailableError when the
        backlog of requests and updates not yet written is full."""
        data = bytes(ForkingPickler.dumps(msg))
        bounded = isinstance(msg, BOUNDED_MESSAGES)
        if bounded:
            with self._backlog_lock:
                if self._backlog + len(data) > self._max_backlog and self._backlog:
                    raise EngineUnavailableError(
                        f"the engine is not keeping up ({self._backlog} bytes not yet delivered)"
                    )
                self._backlog += len(data)
        self._outbox.put((data, bounded))

    @property
    def backlog_bytes(self) -> int:
        with self._backlog_lock:
            return self._backlog

    async def close(self, timeout: float) -> None:
        """Wait up to `timeout` for the process to exit, kill it if it has not, join both
        threads and close the pipe."""
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5.0)
        self._outbox.put(None)
        # With the process gone, a write in progress fails (EPIPE) and a read sees EOF.
        await asyncio.to_thread(self._writer.join, 5.0)
        await asyncio.to_thread(self._reader.join, 5.0)
        self.conn.close()

    # ---- the threads ----

    def _write_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            data, bounded = item
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError) as exc:  # ValueError: closed under us at shutdown
                self._report_lost(f"pipe write failed: {exc}")
                return
            finally:
                if bounded:
                    with self._backlog_lock:
                        self._backlog -= len(data)

    def _read_loop(self) -> None:
        while True:
            try:
                batch = [self.conn.recv()]
                while self.conn.poll():  # everything already here goes over in one hop
                    batch.append(self.conn.recv())
            except (EOFError, OSError, ValueError):
                self._report_lost("the engine process closed its pipe")
                return
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                self._loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[FromEngine]) -> None:
        self.last_message = time.monotonic()
        self._on_messages(self, batch)

    def _report_lost(self, reason: str) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_lost, self, reason)
