"""WeightUpdater: the weight-update state machine of one engine.

An update is checked and accepted (`start`: a source that can be seen to be bad without
reading its tensors fails at once, before anything pauses), waits at step boundaries while a
DRAIN lets running requests finish (`advance`), then is staged (every tensor read and
validated before any parameter changes), applied to running requests by its in-flight policy,
swapped in and published under its version. Its progress goes to `sink` as it happens (the
process loop sends it down the pipe) or collects in `events`, ending with exactly one APPLIED
or FAILED. "An update is in progress" is `pending`, and nowhere else. The caller (LLMEngine)
holds its lock around every call here; updates set an UpdateTarget's tensors (update_target.py).

With tensor parallelism every rank stages its shard and all swap, or none does
(engine/weights/sharded_update.py); versions, policies and events stay here, on rank 0. A
distributed update's tensors arrive over the trainer's group that `begin_join` joins, beside
the steps, and `settle_join` answers for (every rank is in it: engine/weights/transfer_group.py).

After a level-2 sleep the parameters have no storage (`storage.weights_missing`): an update
reallocates it (stale until the swap fills it) and must then set every tensor; a refused or
failed one frees it again. Every applied update is recorded in `origin`, where a wake reads
the served weights again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.kv_cache.prefix_cache import PrefixCache
from engine.models.base import CausalLM
from engine.parallel.step_channel import StepChannel
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import (
    MAX_POLICY_VERSION,
    FinishReason,
    InflightPolicy,
    InitWeightTransfer,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
    WeightTransferJoined,
)
from engine.scheduling.scheduler import Scheduler
from engine.weights.checks import UpdateSize, check_update
from engine.weights.sharded_update import describe, gather_parameters, stage
from engine.weights.staging import StagedWeights, WeightUpdateError
from engine.weights.transfer_group import TransferGroup, begin_all, finish_all, leave_all
from engine.weights.update_target import UpdateTarget
from engine.weights.weights_origin import WeightsOrigin

PROGRESS_INTERVAL_S = 0.1  # at most one LOADING event per interval while staging

Abort = Callable[[list[str], FinishReason, str], int]  # (ids, reason, message) -> sequences ended


class WeightStorage(Protocol):
    """The parameters' storage, which a sleep releases (engine/sleep/model_memory.py)."""

    weights_stale: bool

    @property
    def weights_released(self) -> bool: ...
    @property
    def weights_missing(self) -> bool: ...
    def restore_weights(self) -> None: ...
    def release_weights(self) -> int: ...
    def mark_filled(self) -> None: ...


@dataclass
class PendingUpdate:
    """A weight update accepted but not yet applied (DRAIN waits for running requests)."""

    msg: UpdateWeights
    version: int  # the version it will publish
    started: float  # time.monotonic()
    size: UpdateSize  # what staging reads: the totals of LOADING events
    replaces_all: bool  # every tensor of the model (APPLIED says so: the service's replay log)
    tensors: Mapping[str, torch.Tensor] | None = None  # in-process source
    last_progress: float = 0.0


class WeightUpdater:
    def __init__(
        self,
        model: CausalLM,
        scheduler: Scheduler,
        cache: PrefixCache,
        abort: Abort,
        channel: StepChannel | None = None,
        origin: WeightsOrigin | None = None,
        storage: WeightStorage | None = None,
        draft: CausalLM | None = None,
    ) -> None:
        self.model = model
        self.target = UpdateTarget(model, draft)  # what updates set: a draft model's too
        self.origin = origin  # where the served weights come from (None: not tracked)
        self.storage = storage  # the parameters' storage of an engine that can sleep
        self.channel = channel  # rank 0 of a tensor-parallel group: reaches the workers
        self.scheduler = scheduler  # holds the served policy version (it hashes prefixes)
        self.cache = cache
        self.abort = abort
        self.pending: PendingUpdate | None = None
        self.sink: Callable[[WeightsProgress], None] | None = None
        self.events: list[WeightsProgress] = []  # collected while no sink is installed
        self.last_final: WeightsProgress | None = None  # the last APPLIED or FAILED
        self.transfer = TransferGroup()  # rank 0's membership of a trainer's group, if any
        self.joining: InitWeightTransfer | None = None  # answered by settle_join

    @property
    def in_progress(self) -> bool:
        return self.pending is not None

    @property
    def version(self) -> int:
        return self.scheduler.policy_version

    # ---- the state machine ----

    def start(self, msg: UpdateWeights, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Accept an update, or fail it at once (before PAUSED, admission untouched) if its
        version or its source (check_update) is bad; ABORT, CONTINUE and RECOMPUTE swap now,
        DRAIN stops admitting and swaps in `advance` once nothing runs."""
        if self.pending is not None:
            self.refuse(msg, ErrorCode.FAILED_PRECONDITION, "an update is in progress")
            return
        version = msg.policy_version or self.version + 1
        refusal = self._version_refusal(version)
        if refusal is not None:
            self.refuse(msg, *refusal)
            return
        if self.storage is not None and self.storage.weights_released:
            self.storage.restore_weights()  # NOTE: views of the parameters need their storage
        target = self.target.for_source(msg.checkpoint_dir)
        params, kept = target.checkpoint_tensors(), target.in_format()
        source = describe(
            msg.checkpoint_dir, msg.tensor_file, msg.tensors, tensors, msg.distributed
        )
        try:
            size = check_update(params, target.sharding, source, tensors, kept)
            # The model's tensors the update sets, of all of them (a draft's are extra).
            sets, total = target.model_tensors(size.names), target.model_tensors(params)
            self._check_reachable(msg, sets, total)
        except WeightUpdateError as exc:
            self.refuse(msg, exc.code, exc.message)
            return
        self.pending = PendingUpdate(msg, version, time.monotonic(), size, sets == total, tensors)
        self._event(WeightsPhase.PAUSED, in_flight=len(self.scheduler.running))
        if msg.inflight is InflightPolicy.DRAIN:
            self.scheduler.admitting = False  # new requests wait; advance() swaps
        else:
            self._swap()

    def _check_reachable(self, msg: UpdateWeights, sets: int, tensors: int) -> None:
        """Refusals that depend on the engine's state rather than on the source (`sets` of
        the model's `tensors` tensors)."""
        if msg.distributed is not None and not self.transfer.joined:
            raise WeightUpdateError(
                ErrorCode.FAILED_PRECONDITION,
                "no weight-transfer group: call InitWeightTransfer first (an engine restart or "
                "a failed transfer leaves the group)",
            )
        if msg.complete and sets != tensors:
            raise WeightUpdateError(
                ErrorCode.FAILED_PRECONDITION,
                f"this update must replace every tensor of the model ({tensors}), not "
                f"{sets}: the engine restarted and could not replay weights received "
                "over a process group",
            )
        if self.weights_missing and sets != tensors:
            raise WeightUpdateError(
                ErrorCode.FAILED_PRECONDITION,
                f"the weights were released by a level-2 sleep: an update must set every one "
                f"of the model's {tensors} tensors (this one sets {sets}), or Wake first",
            )

    def begin_join(self, msg: InitWeightTransfer) -> WeightTransferJoined | None:
        """Start joining the trainer's group on every rank, or leave it (msg.group None). The
        answer now for a leave or a refusal; else None, and `settle_join` answers later."""
        if self.pending is not None or self.joining is not None:
            busy = "a weight update" if self.pending is not None else "a weight-transfer join"
            code, message = ErrorCode.FAILED_PRECONDITION, f"{busy} is in progress"
            return WeightTransferJoined(msg.transfer_id, error_code=code, message=message)
        if msg.group is None:
            leave_all(self.model, self.transfer, self.channel)
            return WeightTransferJoined(msg.transfer_id)
        begin_all(self.model, self.transfer, msg.group, self.channel)
        self.joining = msg
        return None

    def settle_join(self) -> WeightTransferJoined | None:
        """At a step boundary: the answer of the join under way once rank 0's has joined,
        failed or run out of its timeout (every rank then holds the group, or none does)."""
        msg, joining = self.joining, self.transfer.joining
        if msg is None or (joining is not None and not joining.settled):
            return None
        self.joining = None
        if joining is None:  # left meanwhile (the engine is closing)
            why = "the engine left the group before the join settled"
            return WeightTransferJoined(msg.transfer_id, 0, ErrorCode.UNAVAILABLE, why)
        try:
            finish_all(self.model, self.transfer, self.channel)
        except WeightUpdateError as exc:
            return WeightTransferJoined(msg.transfer_id, error_code=exc.code, message=exc.message)
        return WeightTransferJoined(msg.transfer_id, engine_ranks=self.model.tp.size)

    def join_due_in(self) -> float | None:
        """Seconds until the join under way must be answered; None without one."""
        joining = self.transfer.joining
        return None if self.joining is None or joining is None else joining.due_in()

    def advance(self) -> None:
        """At a step boundary: swap a draining update once nothing runs, or time it out."""
        update = self.pending
        if update is None or update.msg.inflight is not InflightPolicy.DRAIN:
            return
        if not self.scheduler.running:
            self._swap()
        elif update.msg.drain_timeout is not None:
            waited = time.monotonic() - update.started
            if waited > update.msg.drain_timeout:
                running = len(self.scheduler.running)
                why = f"drain timed out after {waited:.1f}s with {running} requests running"
                if update.msg.distributed is not None:
                    # NOTE: the trainer is already broadcasting: leaving fails it at once,
                    # where it would otherwise wait out the group's timeout.
                    leave_all(self.model, self.transfer, self.channel)
                    why += "; the engine left the weight-transfer group: call InitWeightTransfer"
                self._end(WeightsPhase.FAILED, error_code=ErrorCode.ABORTED, message=why)

    @property
    def weights_missing(self) -> bool:
        return self.storage is not None and self.storage.weights_missing

    def is_pending(self, msg: UpdateWeights) -> bool:
        return self.pending is not None and self.pending.msg is msg

    def outcome(self, msg: UpdateWeights) -> WeightsProgress:
        """The APPLIED event of a finished update, or its failure raised as WeightUpdateError.
        Its events are dropped from `events` (an in-process caller has its answer)."""
        assert not self.is_pending(msg)
        self.events = [e for e in self.events if e.update_id != msg.update_id]
        final = self.last_final
        assert final is not None and final.update_id == msg.update_id
        if final.phase is WeightsPhase.FAILED:
            assert final.error_code is not None  # every FAILED event says why
            raise WeightUpdateError(final.error_code, final.message)
        return final

    @contextlib.contextmanager
    def live(self, policy_version: int) -> Iterator[dict[str, torch.Tensor]]:
        """The served weights to mutate in place, by checkpoint name (views of the parameters:
        checkpoint_tensors); `policy_version` (0 = served + 1) is published on exit as a
        CONTINUE update, nothing if the block raises.

        Tensor parallel: whole copies of the parameters, gathered from every rank; on exit
        every rank stages its slice of them and all swap (nothing changes if the block raises).
        """
        if self.pending is not None:
            raise WeightUpdateError(ErrorCode.FAILED_PRECONDITION, "an update is in progress")
        if self.weights_missing:
            why = "the weights were released by a level-2 sleep: wake first"
            raise WeightUpdateError(ErrorCode.FAILED_PRECONDITION, why)
        version = policy_version or self.version + 1
        refusal = self._version_refusal(version)
        if refusal is not None:
            raise WeightUpdateError(*refusal)
        if not self.model.tp.enabled:
            yield self.model.checkpoint_tensors()
        else:
            whole = gather_parameters(self.model, self.channel)
            yield whole
            source = describe(None, None, (), whole)
            stage(self.target, source, lambda done, count: None, whole, self.channel).apply()
        if self.origin is not None:
            self.origin.forget()  # mutated in place: no copy of these weights to read again
        self._publish(version, InflightPolicy.CONTINUE)

    def _version_refusal(self, version: int) -> tuple[ErrorCode, str] | None:
        """(error code, why) when `version` cannot be the next served version."""
        if version > MAX_POLICY_VERSION:
            return ErrorCode.OUT_OF_RANGE, f"policy_version {version} exceeds {MAX_POLICY_VERSION}"
        if version <= self.version:
            return (
                ErrorCode.FAILED_PRECONDITION,
                f"policy_version {version} must exceed the served {self.version}",
            )
        return None

    def _swap(self) -> None:
        """Stage (validate) the new tensors, handle running requests, swap, publish."""
        update = self.pending
        assert update is not None
        try:
            staged = self._stage(update)
        except WeightUpdateError as exc:
            self._end(WeightsPhase.FAILED, error_code=exc.code, message=exc.message)
            return
        running = list(self.scheduler.running)
        counts = {"aborted": 0, "continued": 0, "recomputed": 0}
        match update.msg.inflight:
            case InflightPolicy.ABORT:
                why = f"aborted by a weight update to policy version {update.version}"
                ids = list(dict.fromkeys(req.request_id for req in running))
                counts["aborted"] = self.abort(ids, FinishReason.ABORTED, why)
            case InflightPolicy.RECOMPUTE:
                counts["recomputed"] = len(running)
                for req in running:
                    self.scheduler.preempt(req)
            case InflightPolicy.CONTINUE:
                counts["continued"] = len(running)
        staged.apply()
        if self.storage is not None:
            self.storage.mark_filled()  # NOTE: start() checked every tensor is staged
        if self.origin is not None:
            msg = update.msg
            self.origin.record(
                describe(msg.checkpoint_dir, msg.tensor_file, msg.tensors, update.tensors)
            )
        previous = self.version
        self._publish(update.version, update.msg.inflight)
        self._end(
            WeightsPhase.APPLIED,
            previous_version=previous,
            replaced_all=update.replaces_all,
            **counts,
        )

    def _stage(self, update: PendingUpdate) -> StagedWeights:
        msg = update.msg

        def progress(bytes_done: int, tensors_done: int) -> None:
            now = time.monotonic()
            if now - update.last_progress >= PROGRESS_INTERVAL_S:
                update.last_progress = now
                self._event(
                    WeightsPhase.LOADING,
                    bytes_done=bytes_done,
                    bytes_total=update.size.bytes,
                    tensors_done=tensors_done,
                    tensors_total=update.size.tensors,
                )

        source = describe(
            msg.checkpoint_dir, msg.tensor_file, msg.tensors, update.tensors, msg.distributed
        )
        staged = stage(self.target, source, progress, update.tensors, self.channel, self.transfer)
        total, count = staged.nbytes, staged.count
        self._event(
            WeightsPhase.LOADING,
            bytes_done=total,
            bytes_total=total,
            tensors_done=count,
            tensors_total=count,
        )
        return staged

    def _publish(self, version: int, inflight: InflightPolicy) -> None:
        """Make `version` the served one. Cached prefixes of older weights are dropped; the KV
        that running requests keep (CONTINUE) mixes versions, so it is never published."""
        self.scheduler.policy_version = version
        self.cache.clear()
        if inflight is InflightPolicy.CONTINUE:
            for req in self.scheduler.running:
                req.publish_pages = False

    # ---- progress ----

    def _event(self, phase: WeightsPhase, **fields: Any) -> None:
        update = self.pending
        assert update is not None
        self._emit(
            WeightsProgress(update.msg.update_id, phase, policy_version=update.version, **fields)
        )

    def _end(self, phase: WeightsPhase, **fields: Any) -> None:
        assert self.pending is not None
        self._event(phase, seconds=time.monotonic() - self.pending.started, **fields)
        self.pending = None
        self.scheduler.admitting = True

    def refuse(self, msg: UpdateWeights, code: ErrorCode, message: str) -> None:
        """Fail `msg` at once, as `start` fails a bad update (one FAILED event)."""
        self._emit(
            WeightsProgress(msg.update_id, WeightsPhase.FAILED, error_code=code, message=message)
        )

    def _emit(self, event: WeightsProgress) -> None:
        if event.final:
            self.last_final = event
        if event.phase is WeightsPhase.FAILED and self.storage and self.storage.weights_stale:
            self.storage.release_weights()  # restored for an update that did not fill it
        if self.sink is not None:
            self.sink(event)
        else:
            self.events.append(event)
