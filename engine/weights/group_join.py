"""GroupJoin: one rank's join of a trainer's process group, on a thread of its own.

Joining blocks in c10d: TCPStore's connect retries for up to twice its timeout when nothing
listens, and waits for ever on a listener that accepts and never answers; the group's
rendezvous waits for every rank. So the join runs beside the engine loop (c10d releases the
GIL while it waits), which keeps stepping and polls `settled`. At `deadline` the loop gives
up on it: the thread is abandoned, its late result (a group, or an error) is dropped, and it
ends when c10d does (or with the process). A rank holds few abandoned joins at a time:
MAX_ABANDONED, after which a new join is refused until the earlier ones end.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import TransferGroupSpec
from engine.weights.staging import WeightUpdateError

# Abandoned joins still blocked in c10d (each a thread and a socket); a listener that never
# answers keeps one blocked until it closes the connection.
MAX_ABANDONED = 4


@dataclass
class Membership:
    """A joined group: its process group and the store client it lives on."""

    group: Any
    store: Any


def connect(spec: TransferGroupSpec, rank: int, device: torch.device) -> Membership:
    """Join `spec`'s group as `rank` (blocks; see the module docstring). WeightUpdateError
    UNAVAILABLE if c10d gives up first (no store, no rendezvous)."""
    timeout = datetime.timedelta(seconds=spec.timeout)
    try:
        store = dist.TCPStore(
            spec.master_address, spec.master_port, spec.world_size, False, timeout=timeout
        )
        prefixed = dist.PrefixStore(spec.group_name, store)
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group: Any = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
    except (RuntimeError, ValueError) as exc:  # c10d's timeouts and connection errors
        raise WeightUpdateError(
            ErrorCode.UNAVAILABLE, _could_not_join(spec, rank, str(exc))
        ) from exc
    return Membership(group, store)


def _could_not_join(spec: TransferGroupSpec, rank: int, why: str) -> str:
    where = f"{spec.master_address}:{spec.master_port}"
    return (
        f"could not join the weight-transfer group {spec.group_name!r} at {where} as rank "
        f"{rank} of {spec.world_size} within {spec.timeout:g} s: {why}"
    )


class GroupJoin:
    """A join under way (or refused at once: `failed`). `on_done` runs on the join's thread
    when c10d returns, to wake an idle loop."""

    def __init__(
        self,
        spec: TransferGroupSpec,
        rank: int,
        device: torch.device,
        on_done: Callable[[], None] | None = None,
        failed: WeightUpdateError | None = None,
    ) -> None:
        self.spec, self.rank, self.device = spec, rank, device
        self.deadline = time.monotonic() + spec.timeout
        self._done = threading.Event()
        self._result: Membership | WeightUpdateError | None = failed
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # orders `abandon` against the thread's end
        self._abandoned = False
        if failed is not None:
            self._done.set()
            return

        def run() -> None:
            try:
                self._result = connect(spec, rank, device)
            except WeightUpdateError as exc:
                self._result = exc
            finally:
                with self._lock:
                    self._done.set()
                    if self._abandoned:
                        self._drop()
                if on_done is not None:
                    on_done()

        self._thread = threading.Thread(target=run, name="sluice-transfer-join", daemon=True)
        self._thread.start()

    @property
    def settled(self) -> bool:
        """Joined, failed, or out of time: the loop can answer."""
        return self._done.is_set() or time.monotonic() >= self.deadline

    @property
    def blocked(self) -> bool:
        """Still inside c10d."""
        return not self._done.is_set()

    def due_in(self) -> float:
        """Seconds until the deadline (0 once settled)."""
        return 0.0 if self._done.is_set() else max(0.0, self.deadline - time.monotonic())

    def wait(self, seconds: float) -> None:
        self._done.wait(max(0.0, seconds))

    def abandon(self) -> bool:
        """Nobody waits for this join any more: a group it forms late is dropped (an NCCL one
        aborted). True while it is still blocked in c10d."""
        with self._lock:
            self._abandoned = True
            if self._done.is_set():
                self._drop()
                return False
            return True

    def _drop(self) -> None:
        result, self._result = self._result, None
        if isinstance(result, Membership) and hasattr(result.group, "abort"):
            with contextlib.suppress(RuntimeError):
                result.group.abort()

    def membership(self) -> Membership:
        """The group joined; WeightUpdateError UNAVAILABLE if the join failed or is not done
        (the caller then abandons it)."""
        result = self._result if self._done.is_set() else None
        if isinstance(result, Membership):
            return result
        if isinstance(result, WeightUpdateError):
            raise result
        why = "no answer from the store or the other ranks in time"
        raise WeightUpdateError(ErrorCode.UNAVAILABLE, _could_not_join(self.spec, self.rank, why))
