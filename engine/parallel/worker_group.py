"""WorkerGroup: rank 0's handle on the other tensor-parallel ranks (worker processes).

Rank 0 (the engine process) serves the rendezvous store, spawns ranks 1..N-1 (each runs
engine/tp_worker.py's `worker_main`), joins the process group with them, and from then on:
- tells them every step through the model runner's StepChannel;
- pings them when idle, so an idle group stays inside the collective timeout;
- watches their liveness: a worker that exits (`engine.worker_died`), or stops stamping its
  RankBeats slot (`engine.worker_hung`: stopped, frozen), takes rank 0's whole process down at
  once, so no rank is left waiting in a collective for a peer that is gone or stuck.
  The service then sees its engine exit and restarts the whole group. Workers, in turn, die
  with rank 0 (die_with_parent): none outlives the engine, hence none outlives the server.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.parallel.rank_beats import BEAT_INTERVAL_S, RankBeats
from engine.parallel.step_channel import Op, StepChannel, StepHeader
from engine.parallel.tensor_parallel import (
    COLLECTIVE_TIMEOUT_S,
    TensorParallel,
    init_rank,
    leave_group,
    rendezvous_store,
)
from engine.parent_death import children_allowed
from engine.protocol.config import EngineConfig

PING_INTERVAL_S = COLLECTIVE_TIMEOUT_S / 10
STOP_TIMEOUT_S = 10.0

log = structlog.get_logger("sluice.engine")


class WorkerGroup:
    def __init__(
        self, config: EngineConfig, path: Path, device: torch.device, worker_main: Callable
    ) -> None:
        """Spawn ranks 1..N-1 running `worker_main` (engine/tp_worker.py's, passed in: the
        worker sits above this package) and join the group with them (blocks until all have)."""
        size = config.tensor_parallel_size
        store = rendezvous_store(size)
        ctx = multiprocessing.get_context("spawn")
        self.processes: list[Any] = []
        self.closing = False
        self.channel: StepChannel | None = None
        self.beats = RankBeats(ctx, size - 1)
        with children_allowed():
            for rank in range(1, size):
                process = ctx.Process(
                    target=worker_main,
                    args=(config, str(path), rank, store.port, self.beats),
                    name=f"sluice-engine-rank{rank}",
                    daemon=True,
                )
                process.start()
                self.processes.append(process)
                log.info("engine.worker_spawned", rank=rank, worker_pid=process.pid)
        self._watcher = threading.Thread(target=self._watch, name="tp-watcher", daemon=True)
        self._watcher.start()
        self.tp: TensorParallel = init_rank(store, 0, size, device)
        self._store = store  # NOTE: the store must outlive the group: workers still read it

    def attach(self, channel: StepChannel, lock: Any) -> None:
        """Start pinging through `channel` (rank 0's), holding `lock` (the engine's) to send."""
        self.channel = channel
        self._lock = lock
        threading.Thread(target=self._ping, name="tp-ping", daemon=True).start()

    def close(self) -> None:
        """Stop the workers (STOP, then wait; killed after STOP_TIMEOUT_S) and leave the group."""
        if self.closing:
            return
        self.closing = True
        if self.channel is not None:
            with self._lock:
                self.channel.send(StepHeader(Op.STOP))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        leave_group()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        while True:
            ready = wait(list(sentinels), timeout=BEAT_INTERVAL_S)
            if self.closing:
                return
            if ready:
                dead = sentinels[ready[0]]
                log.critical(
                    "engine.worker_died",
                    rank=self.processes.index(dead) + 1,
                    worker_pid=dead.pid,
                    exitcode=dead.exitcode,
                    reason="a tensor-parallel rank exited: the engine cannot run without it",
                )
                break
            if (silent := self.beats.silent()) is not None:
                slot, seconds = silent
                log.critical(
                    "engine.worker_hung",
                    rank=slot + 1,
                    worker_pid=self.processes[slot].pid,
                    silent_s=round(seconds, 1),
                    reason="a tensor-parallel rank stopped showing signs of life",
                )
                break
        for process in self.processes:
            if process.is_alive():
                process.kill()  # SIGKILL: also ends a stopped one
        # NOTE: not an exception: the main thread may be blocked in a collective with the dead
        # rank, and it would never see one. The service restarts the whole group.
        os._exit(1)

    def _ping(self) -> None:
        assert self.channel is not None
        while not self.closing:
            time.sleep(PING_INTERVAL_S / 4)
            with self._lock:
                if self.closing:
                    return
                if time.monotonic() - self.channel.last_send > PING_INTERVAL_S:
                    self.channel.send(StepHeader(Op.PING))
