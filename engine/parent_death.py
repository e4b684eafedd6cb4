"""Tying a process's life to its parent's: the engine to the service, a worker to rank 0 (or
a grammar compile worker to the engine).

Standard library and structlog only: the engine process and every tensor-parallel worker call
`die_with_parent` first thing, before anything heavy is imported.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

import structlog

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = structlog.get_logger("sluice.engine")


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies, or exit now if it already has.

    EOF on the pipe ends a running engine whose service is gone, but not a stopped (SIGSTOP) or
    hung one: without this it would be left orphaned forever after a `kill -9` of the service.
    Linux only; elsewhere a no-op (the pipe's EOF remains the only way out).

    NOTE: the signal fires when the parent *thread* that started this process exits, not the
    whole parent process. The service starts the engine from its main (event-loop) thread, which
    lives as long as the service; starting it from a worker thread (asyncio.to_thread, an
    executor) would kill the engine as soon as that thread ends.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("engine.prctl_failed", option="PR_SET_PDEATHSIG", error=os.strerror(err))
        return
    # The parent may have died before prctl: this process is then already re-parented (to init
    # or a subreaper) and the signal will never come.
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        log.error("engine.orphaned", parent_pid=parent.pid)
        raise SystemExit(1)


class children_allowed:
    """Let a daemonic process (the service starts the engine as one, so that it never
    outlives the service) start the worker processes multiprocessing would otherwise refuse
    it: they are tied to it by die_with_parent (and their own liveness checks) instead."""

    def __enter__(self) -> None:
        self.me = multiprocessing.current_process()
        self.was = self.me._config.get("daemon", False)  # type: ignore[attr-defined]
        self.me._config["daemon"] = False  # type: ignore[attr-defined]

    def __exit__(self, *exc: object) -> None:
        self.me._config["daemon"] = self.was  # type: ignore[attr-defined]
