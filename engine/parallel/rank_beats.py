"""RankBeats: each tensor-parallel worker's sign of life, in memory rank 0 shares with them.

An idle worker's main thread waits in a collective for rank 0's next message for as long as
the engine is idle, so that thread's progress says nothing. Instead a thread of each worker
stamps the worker's slot every BEAT_INTERVAL_S; a worker that is stopped (SIGSTOP), frozen or
starved of the CPU stops stamping, and rank 0's watcher (engine/parallel/worker_group.py) takes the
whole engine down once a slot is older than SILENCE_LIMIT_S, idle or busy: the service then
restarts the group. A worker whose main thread alone hangs (in a collective) still stamps: the
collective timeout and the service's stall timeout end that one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

BEAT_INTERVAL_S = 0.25
# Well inside the service's default heartbeat timeout (15 s), and far above any pause of a
# thread that only sleeps and stamps.
SILENCE_LIMIT_S = 3.0


class RankBeats:
    """One monotonic-clock stamp per worker (slot r - 1 for rank r); 0.0 until its first."""

    def __init__(self, ctx: Any, workers: int) -> None:
        self.stamps = ctx.RawArray("d", workers)  # NOTE: inherited by the spawned workers

    def start_beating(self, slot: int) -> None:
        """In the worker: stamp `slot` from a daemon thread until the process ends."""
        threading.Thread(target=self._beat, args=(slot,), name="tp-beat", daemon=True).start()

    def _beat(self, slot: int) -> None:
        while True:
            self.stamps[slot] = time.monotonic()
            time.sleep(BEAT_INTERVAL_S)

    def silent(self) -> tuple[int, float] | None:
        """(slot, seconds) of a worker silent for more than SILENCE_LIMIT_S, else None. A
        worker that has not stamped yet is not judged (it is still starting)."""
        now = time.monotonic()
        for slot, stamp in enumerate(self.stamps):
            if stamp and now - stamp > SILENCE_LIMIT_S:
                return slot, now - stamp
        return None
