"""EngineProcess: one incarnation of the engine process and the service's end of its pipe.

Neither direction of the pipe ever blocks the event loop. The service's end of the pipe is
non-blocking: the loop reads whatever has arrived when the pipe is readable, cuts it into
messages (multiprocessing's framing: a length, then the pickle) and hands each batch on at once,
with no thread in between; a message still arriving just waits for more bytes. A writer thread
sends what `send` queues, waiting for the pipe to take more when it is full. A stopped or hung
engine therefore stalls only the writer: the loop keeps answering health checks and runs the
supervisor that will kill the engine. What waits for the writer is bounded
(`max_backlog_bytes`); past it `send` refuses new requests, so a request that cannot be handed
to the engine is answered at once instead of piling up.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import select
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler

from engine.protocol.config import EngineConfig
from engine.protocol.messages import AddRequest, FromEngine, ModelInfo, ToEngine, UpdateWeights

EngineTarget = Callable[[EngineConfig, Connection], None]
StartProcess = Callable[[BaseProcess], None]  # BaseProcess.start, or service.ops.priority's
# Messages that carry caller payloads count against the backlog; control messages (abort,
# state, shutdown) always pass, so a cancel is never lost to a full queue.
BOUNDED_MESSAGES = (AddRequest, UpdateWeights)
# The loop reads at most READ_LIMIT bytes per wake-up (then lets other callbacks run), in
# reads of READ_SIZE.
READ_SIZE = 256 * 1024
READ_LIMIT = 4 * 1024 * 1024


class EngineUnavailableError(RuntimeError):
    """The engine cannot take this message now (starting, restarting, stopping, or backed up)."""


class EngineStartError(RuntimeError):
    """The engine process died or timed out before it was ready to serve."""


class EngineProcess:
    """Spawns the engine (`spawn` context), reads its pipe on the event loop and writes it from
    a thread.

    `on_messages(self, batch)` runs on the event loop for every batch of messages read at once;
    `on_lost(self, reason)` runs there when a read or a write finds the pipe closed. `ready` and
    `lost` are the owner's to resolve and set (the owner decides what a message means).
    `start_process` starts the process (default: from the calling thread). `close()` ends the
    process (killing it if it hangs) before it joins the writer: only then can a writer stuck in
    a write to a stopped engine return.
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
        self._fd = self.conn.fileno()
        os.set_blocking(self._fd, False)
        self._frames = FrameReader()
        self._writer = threading.Thread(target=self._write_loop, name="engine-writer", daemon=True)
        self._writer.start()
        self._loop.add_reader(self._fd, self._read)
        self._reading = True

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
        """Wait up to `timeout` for the process to exit, kill it if it has not, join the
        writer and close the pipe."""
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5.0)
        self._outbox.put(None)
        # With the process gone, a write in progress fails (EPIPE).
        await asyncio.to_thread(self._writer.join, 5.0)
        self._stop_reading()
        self.conn.close()

    # ---- the pipe ----

    def _write_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            data, bounded = item
            try:
                write_frame(self._fd, data)
            except OSError as exc:  # EPIPE, ECONNRESET; EBADF: closed under us at shutdown
                self._report_lost(f"pipe write failed: {exc}")
                return
            finally:
                if bounded:
                    with self._backlog_lock:
                        self._backlog -= len(data)

    def _read(self) -> None:
        """On the loop, when the pipe is readable: everything that arrived, as messages."""
        try:
            complete = self._frames.feed(self._fd)
        except (EOFError, OSError) as exc:
            self._stop_reading()
            reason = "the engine process closed its pipe"
            self._on_lost(self, reason if isinstance(exc, EOFError) else f"{reason}: {exc}")
            return
        if complete:
            self.last_message = time.monotonic()
            self._on_messages(self, [ForkingPickler.loads(frame) for frame in complete])

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _report_lost(self, reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self._on_lost, self, reason)


class FrameReader:
    """Cuts a byte stream into multiprocessing.Connection's messages: a 4-byte big-endian
    signed length, or -1 and then an 8-byte length (messages of 2 GiB and more), then that many
    bytes."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, fd: int) -> list[bytes]:
        """Read what `fd` (non-blocking) has, up to READ_LIMIT; return the messages now
        complete. EOFError at the end of the stream."""
        for _ in range(READ_LIMIT // READ_SIZE):
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            if not data:
                raise EOFError
            self._buffer += data
            if len(data) < READ_SIZE:
                break
        return self.frames()

    def frames(self) -> list[bytes]:
        """The messages complete in the buffer, removed from it."""
        buffer, complete, start = self._buffer, [], 0
        while len(buffer) - start >= 4:
            (size,) = struct.unpack_from("!i", buffer, start)
            header = 4
            if size == -1:
                if len(buffer) - start < 12:
                    break
                (size,) = struct.unpack_from("!Q", buffer, start + 4)
                header = 12
            end = start + header + size
            if len(buffer) < end:
                break
            complete.append(bytes(buffer[start + header : end]))
            start = end
        del buffer[:start]
        return complete


def write_frame(fd: int, data: bytes) -> None:
    """Write `data` as one multiprocessing.Connection message to `fd` (non-blocking), waiting
    while the pipe is full."""
    size = len(data)
    header = struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)
    # Like Connection: a small message goes out with its header in one write.
    for part in [header + data] if size <= 16384 else [header, data]:
        view = memoryview(part)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                _wait_writable(fd)


def _wait_writable(fd: int) -> None:
    # NOTE: poll, not select: select fails on descriptors past 1024 (a busy server has them).
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    poller.poll()
