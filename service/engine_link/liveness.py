"""Liveness: whether a silent, idle engine is hung or only starved of CPU.

An idle engine sends a Heartbeat every second, but only when the kernel runs it: on a machine
whose cores are oversubscribed, a healthy engine can wait many seconds for a CPU, and its
silence then says nothing about its health. So an idle engine's late heartbeat is a question,
not a verdict:

1. Once the heartbeat is late (silent past `heartbeat_timeout`), the service probes the engine
   (a GetState, which it answers with a Heartbeat as soon as its loop runs) and looks at the
   process's scheduler state in /proc/<pid>/stat at every watch tick.
2. A stopped process (state T or t: `kill -STOP`, a debugger) is hung at once.
3. An engine whose main thread has not been seen runnable (state R: running or waiting for a
   CPU) for `heartbeat_timeout` seconds is hung: it sleeps on something other than its pipe
   (a deadlock, a lost wake-up), since a probe in its pipe would have woken it.
4. An engine that stays runnable but never answers is hung at the hard bound, `stall_timeout`
   seconds of silence: a starved engine gets that long, and so does a main thread spinning in
   a loop that never reaches the pipe.

Where /proc is missing (not Linux) the state is unknown and rule 3 applies as if the engine
were never runnable: the late heartbeat alone decides, as it did before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

STOPPED_STATES = frozenset("Tt")  # stopped by a signal, or by a tracer
RUNNABLE_STATES = frozenset("R")  # running, or waiting on a run queue for a CPU


def process_state(pid: int) -> str | None:
    """The scheduler state letter of `pid`'s main thread (R, S, D, T, t, Z ...), or None when
    it cannot be read (no /proc, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'.
    _, _, rest = stat.rpartition(")")
    fields = rest.split()
    return fields[0] if fields else None


@dataclass
class Liveness:
    """The judgement of one engine process's silence; one per engine incarnation.

    `observe` is called at every watch tick while the engine is idle; it returns why the engine
    is hung, or None. `probe_due` says when the late heartbeat calls for a probe (once per
    silence: any message from the engine starts a new one)."""

    pid: int
    heartbeat_timeout: float
    stall_timeout: float
    last_runnable: float = field(default_factory=time.monotonic)
    probed_after: float | None = None  # the `last_message` whose silence has been probed

    def probe_due(self, last_message: float, now: float) -> bool:
        if now - last_message <= self.heartbeat_timeout or self.probed_after == last_message:
            return False
        self.probed_after = last_message
        return True

    def observe(self, last_message: float, now: float) -> str | None:
        state = process_state(self.pid)
        if state in RUNNABLE_STATES:
            self.last_runnable = now
        silent = now - last_message
        if silent <= self.heartbeat_timeout:
            return None
        if state in STOPPED_STATES:
            return f"no progress for {silent:.1f}s while idle: the engine process is stopped"
        if now - max(self.last_runnable, last_message) > self.heartbeat_timeout:
            return f"no progress for {silent:.1f}s while idle: the engine does not answer a probe"
        if silent > self.stall_timeout:
            return (
                f"no progress for {silent:.1f}s while idle: the engine runs but does not answer "
                "a probe (past --stall-timeout)"
            )
        return None
