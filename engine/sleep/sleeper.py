"""Sleeper: the sleep state machine of one engine.

A Sleep frees memory while the engine serves nothing: level 1 the KV pool and the prefix cache,
level 2 the weights too. Its in-flight policy: ABORT ends every request in the engine (reason
ABORTED, partial output kept) and sleeps at once; DRAIN lets every request already in the
engine run to completion and sleeps at the first step boundary with none left, or fails ABORTED
once its drain timeout passes (nothing changed, serving goes on). From the Sleep until the Wake
the engine takes no new request (`refusing`). A Sleep while asleep deepens the level (1 -> 2)
and never makes it shallower; a Wake while awake does nothing.

A Wake from level 2 first needs the weights back: an update that set every tensor while asleep
may have restored them; otherwise they are read again from their origin (WeightsOrigin), at the
served version. When that is impossible (the origin is unknown or unreadable) the Wake fails
FAILED_PRECONDITION and the engine stays asleep: it never serves weights that do not match
its version. Then the KV pool is reallocated (same pages) and CUDA graphs captured again. A
speculative draft model's weights and KV pool sleep and wake with the model's (DraftMemory).

Each Sleep and Wake ends with exactly one SleepOutcome, sent to `sink` (the process loop sends
it down the pipe) or collected in `events`. The caller (LLMEngine) holds its lock around every
call here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.kv_cache.prefix_cache import PrefixCache
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import (
    SLEEP_LEVELS,
    FinishReason,
    InflightPolicy,
    Sleep,
    SleepOutcome,
    Wake,
)
from engine.sleep.draft_memory import DraftMemory
from engine.sleep.model_memory import ModelMemory
from engine.weights.staging import WeightUpdateError
from engine.weights.weight_updater import Abort, WeightUpdater


class SleepError(Exception):
    """A refused or failed Sleep or Wake (in-process API); `code` says why (an ErrorCode)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class PendingSleep:
    """A DRAIN sleep waiting for the requests in the engine to finish."""

    msg: Sleep
    started: float  # time.monotonic()


class Sleeper:
    def __init__(
        self,
        memory: ModelMemory,
        cache: PrefixCache,
        updater: WeightUpdater,
        abort: Abort,
        request_ids: Callable[[], list[str]],
        draft: DraftMemory | None = None,
    ) -> None:
        self.memory = memory
        self.draft = draft  # the speculative draft model's, freed and restored with the model's
        self.cache = cache
        self.updater = updater
        self.abort = abort
        self.request_ids = request_ids  # every request in the engine, running or waiting
        self.level = 0  # 0 awake, else the SLEEP_LEVELS level the engine sleeps at
        self.pending: PendingSleep | None = None
        self.sink: Callable[[SleepOutcome], None] | None = None
        self.events: list[SleepOutcome] = []  # collected while no sink is installed

    @property
    def in_progress(self) -> bool:
        return self.pending is not None

    @property
    def refusing(self) -> str | None:
        """Why the engine takes no new request now; None when it does."""
        if self.level:
            return f"the engine is asleep (level {self.level}): Wake it first"
        if self.pending is not None:
            return "the engine is going to sleep"
        return None

    # ---- sleep ----

    def start(self, msg: Sleep) -> None:
        """Accept a Sleep (or refuse it at once); ABORT sleeps now, DRAIN in `advance`."""
        started = time.monotonic()
        refusal = self._refusal(msg)
        if refusal is not None:
            self._answer(msg.sleep_id, started, error_code=refusal[0], message=refusal[1])
        elif self.level:  # asleep already: only deeper
            released = 0
            if msg.level == 2 and not self.memory.weights_released:
                released = self.memory.release_weights()
                released += self.draft.release(2) if self.draft is not None else 0
                self.level = 2
            self._answer(msg.sleep_id, started, released_bytes=released)
        elif msg.inflight is InflightPolicy.ABORT:
            why = f"aborted: the engine went to sleep (level {msg.level})"
            aborted = self.abort(self.request_ids(), FinishReason.ABORTED, why)
            self._fall_asleep(msg, started, aborted)
        else:
            self.pending = PendingSleep(msg, started)
            self.advance()

    def advance(self) -> None:
        """At a step boundary: sleep once no request is left, or time the drain out."""
        pending = self.pending
        if pending is None:
            return
        if not self.request_ids():
            self.pending = None
            self._fall_asleep(pending.msg, pending.started, 0)
            return
        waited = time.monotonic() - pending.started
        timeout = pending.msg.drain_timeout
        if timeout is not None and waited > timeout:
            self.pending = None
            count = len(self.request_ids())
            why = f"drain timed out after {waited:.1f}s with {count} requests in the engine"
            self._answer(
                pending.msg.sleep_id, pending.started, error_code=ErrorCode.ABORTED, message=why
            )

    def _refusal(self, msg: Sleep) -> tuple[ErrorCode, str] | None:
        if msg.level not in SLEEP_LEVELS:
            return ErrorCode.INVALID_ARGUMENT, f"level: must be 1 or 2, not {msg.level}"
        if msg.inflight not in (InflightPolicy.DRAIN, InflightPolicy.ABORT):
            return (
                ErrorCode.INVALID_ARGUMENT,
                f"inflight: {msg.inflight.value} is not DRAIN or ABORT",
            )
        if self.updater.model.tp.enabled:
            return ErrorCode.FAILED_PRECONDITION, "sleep is not supported with tensor parallelism"
        if self.pending is not None:
            return ErrorCode.FAILED_PRECONDITION, "a sleep is already draining"
        if self.updater.in_progress:
            return ErrorCode.FAILED_PRECONDITION, "a weight update is in progress"
        return None

    def _fall_asleep(self, msg: Sleep, started: float, aborted: int) -> None:
        self.cache.clear()  # every request has ended: every page is free now
        released = self.memory.release_kv()
        if msg.level == 2:
            released += self.memory.release_weights()
        if self.draft is not None:
            released += self.draft.release(msg.level)
        self.level = msg.level
        self._answer(msg.sleep_id, started, aborted=aborted, released_bytes=released)

    # ---- wake ----

    def wake(self, msg: Wake) -> None:
        """Reload the weights if they are gone, reallocate the KV pool, serve again."""
        started = time.monotonic()
        if self.pending is not None:
            why = "a sleep is draining: wait for its answer, then Wake"
            self._answer(
                msg.sleep_id, started, error_code=ErrorCode.FAILED_PRECONDITION, message=why
            )
            return
        if not self.level:
            self._answer(msg.sleep_id, started)  # awake already
            return
        # NOTE: the draft first: the model's origin may hold draft tensors too (update_target.py)
        if self.draft is not None:
            try:
                self.draft.restore()
            except Exception as exc:  # its directory gone or changed since the start
                why = f"cannot read the speculative draft model again: {exc}"
                code = ErrorCode.FAILED_PRECONDITION
                self._answer(msg.sleep_id, started, error_code=code, message=why)
                return
        reloaded = self.memory.weights_missing
        if reloaded:
            failure = self._reload_weights()
            if failure is not None:
                code = ErrorCode.FAILED_PRECONDITION
                self._answer(msg.sleep_id, started, error_code=code, message=failure)
                return
        self.memory.restore_kv()
        self.level = 0
        self._answer(msg.sleep_id, started, reloaded=reloaded)

    def _reload_weights(self) -> str | None:
        """Fill the released weights from their origin; why not, when it cannot."""
        origin = self.updater.origin
        if origin is None or not origin.known:
            return (
                "the weights were released by a level-2 sleep and the served ones came from "
                "tensors the server does not keep: apply an update that sets every tensor "
                "(a checkpoint_dir), then Wake"
            )
        if self.memory.weights_released:
            self.memory.restore_weights()
        try:
            origin.reload(self.updater.target, self.updater.channel)
        except WeightUpdateError as exc:
            self.memory.release_weights()  # NOTE: partly loaded weights are never served
            return f"cannot read the served weights again: {exc.message}"
        self.memory.mark_filled()
        self.memory.prepack_weights()
        return None

    # ---- outcomes ----

    def _answer(self, sleep_id: str, started: float, **fields: Any) -> None:
        level = self.level
        version = self.updater.version
        seconds = time.monotonic() - started
        outcome = SleepOutcome(sleep_id, level, policy_version=version, seconds=seconds, **fields)
        if self.sink is not None:
            self.sink(outcome)
        else:
            self.events.append(outcome)

    def outcome(self, sleep_id: str) -> SleepOutcome:
        """The answer to `sleep_id` (taken out of `events`), or its failure raised as
        SleepError."""
        found = [e for e in self.events if e.sleep_id == sleep_id]
        assert len(found) == 1, f"no single answer to {sleep_id}"
        self.events.remove(found[0])
        if found[0].error_code is not None:
            raise SleepError(found[0].error_code, found[0].message)
        return found[0]
