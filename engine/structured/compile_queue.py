"""CompileQueue: the compiles waiting for a worker, handed out fairly between callers.

A caller is who asked (the service passes the gRPC peer: one connection); the engine's own
compiles are the caller "". Each caller has its own FIFO; `take` serves the callers in turn,
the one served least recently first, and never a caller that has a compile running (or a
worker being replaced after its compile was killed). So one caller's compiles, however many or
costly, hold at most one worker, and never queue another caller's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.protocol.messages import Constraint


@dataclass(eq=False)
class CompileJob:
    constraint: Constraint
    caller: str
    future: Future[Any] = field(default_factory=Future)
    waiters: int = 1  # requests and checks waiting on it (the engine thread's count)
    slot: int | None = None  # the worker slot compiling it, once taken
    abandoned: bool = False  # every waiter left: cancel it (under the queue's lock)
    settled: bool = False  # its outcome is decided: abandoning it no longer cancels it


class CompileQueue:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._waiting: OrderedDict[str, deque[CompileJob]] = OrderedDict()  # caller -> jobs
        self._busy: set[str] = set()  # callers with a compile running
        self._closed = False

    def put(self, job: CompileJob) -> None:
        with self.lock:
            self._waiting.setdefault(job.caller, deque()).append(job)
            self.lock.notify()

    def take(self, slot: int) -> CompileJob | None:
        """The next job, for worker `slot` (blocks until there is one); None once closed."""
        with self.lock:
            while not self._closed:
                for caller, jobs in self._waiting.items():
                    if caller not in self._busy:
                        job = jobs.popleft()
                        if jobs:
                            self._waiting.move_to_end(caller)
                        else:
                            del self._waiting[caller]
                        self._busy.add(caller)
                        job.slot = slot
                        return job
                self.lock.wait()
            return None

    def remove(self, job: CompileJob) -> bool:
        """Drop a job not taken yet; False if it was taken. Call with `lock` held."""
        jobs = self._waiting.get(job.caller)
        if jobs is None or job not in jobs:
            return False
        jobs.remove(job)
        if not jobs:
            del self._waiting[job.caller]
        return True

    def finish(self, job: CompileJob) -> None:
        """The job's worker is free again: its caller may have another compile run."""
        with self.lock:
            self._busy.discard(job.caller)
            self.lock.notify_all()

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.lock.notify_all()

    def __len__(self) -> int:
        with self.lock:
            return sum(len(jobs) for jobs in self._waiting.values())
