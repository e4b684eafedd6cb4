"""Yielding the CPU to the engine: the service's threads run below the engine's priority.

Where the engine shares cores with the service (a CPU deployment, or a GPU one whose engine loop
needs a core to launch kernels), the engine's steps set the throughput, while the service can
fall a little behind at no cost: a stream whose previous message is still being written sends
what arrived meanwhile as one message. So `sluice serve` raises the nice value of its own threads
and starts every engine process from one thread kept at the starting priority: the engine, a
process of its own, runs at the priority the server was started with, and wins the CPU whenever
both want it.

Linux only, where a nice value belongs to a thread and a new thread or process inherits its
creator's; elsewhere `yield_to_engine` returns None and changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

T = TypeVar("T")


class Spawner:
    """One long-lived thread that keeps the priority this process had when it was made: what
    `run` starts there (a process, a subprocess) gets that priority, whatever the other
    threads' nice values are by then.

    The engine asks the kernel to kill it when the thread that started it exits; this thread
    lives as long as the service.
    """

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        # The executor creates its thread on the first submit, from the submitting thread: now,
        # before anything lowers this one's priority.
        self.native_id: int = self._thread.submit(threading.get_native_id).result()

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` called on the spawner's thread; waits for it."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def start(self, process: BaseProcess) -> None:
        self.run(process.start)


def yield_to_engine(niceness: int) -> Spawner | None:
    """Lower this process's priority by `niceness` (see `lower_priority`), except a Spawner's
    thread, which is returned: start engines with it.

    None, and nothing changed, when `niceness` is 0 or this is not Linux. Call it early, from the
    main thread, before the gRPC server and the engine start.
    """
    if niceness == 0 or not sys.platform.startswith("linux"):
        return None
    spawner = Spawner()
    lower_priority(niceness, spare=spawner.native_id)
    return spawner


def lower_priority(niceness: int, spare: int | None = None) -> None:
    """Raise the nice value of every thread of this process by `niceness` (Linux clamps it to
    19), except the thread whose native id is `spare`. Threads created later inherit their
    creator's value. Linux only."""
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        if tid == spare:
            continue
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
