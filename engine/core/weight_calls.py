"""LLMEngine's calls on its weights and its sleep: the ones the process loop makes (start an
update, join a trainer's group, start a sleep, wake) and the in-process ones that wait for their
outcome (engine/core/in_process.py). The state machines are WeightUpdater's
(engine/weights/weight_updater.py) and Sleeper's (engine/sleep/sleeper.py); each call settles
the step loop first, so a swap never lands under a launched step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from engine.core import in_process
from engine.core.request_table import RequestTable
from engine.core.step_loop import StepLoop
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import (
    InflightPolicy,
    InitWeightTransfer,
    RequestOutput,
    Sleep,
    SleepOutcome,
    UpdateWeights,
    Wake,
    WeightsProgress,
    WeightTransferJoined,
)
from engine.sleep.sleeper import Sleeper
from engine.weights.in_format import in_format
from engine.weights.quantization import dequantize_update, read_quantization
from engine.weights.staging import WeightUpdateError
from engine.weights.weight_updater import WeightUpdater


class WeightAndSleepCalls:
    """A part of LLMEngine (engine/core/llm_engine.py), which sets these attributes."""

    lock: threading.RLock
    loop: StepLoop
    table: RequestTable
    updater: WeightUpdater
    sleeper: Sleeper

    def step(self) -> Sequence[RequestOutput]:
        raise NotImplementedError  # LLMEngine.step

    def start_weight_update(
        self, msg: UpdateWeights, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Accept an update; it applies now (ABORT, CONTINUE, RECOMPUTE) or once running
        requests have finished (DRAIN). Progress goes to `updater.sink` (or `updater.events`),
        ending with one APPLIED or FAILED. `tensors` is the in-process source (no file, no
        checkpoint)."""
        with self.lock:
            self.loop.settle()
            if self.sleeper.in_progress:
                self.updater.refuse(msg, ErrorCode.FAILED_PRECONDITION, "a sleep is draining")
                return
            if tensors is not None:  # quantized ones with their scales: dequantized first
                model = self.updater.model
                quantization = read_quantization(model.config.raw)
                dtype = next(model.parameters()).dtype  # NOTE: no storage after a level-2 sleep
                keep = in_format(model).slots  # in format: copied with their scales
                try:
                    tensors = dequantize_update(tensors, quantization, dtype, keep)
                except ValueError as exc:
                    self.updater.refuse(msg, ErrorCode.INVALID_ARGUMENT, str(exc))
                    return
            self.updater.start(msg, tensors)

    def begin_weight_transfer(self, msg: InitWeightTransfer) -> WeightTransferJoined | None:
        """Start joining a trainer's process group on every rank (msg.group None: leave it),
        for updates with a `distributed` source; steps go on meanwhile. The answer now (a
        leave, a refusal), or None: `settle_weight_transfer` answers once the join settles, at
        most the group's timeout later."""
        with self.lock:
            return self.updater.begin_join(msg)

    def settle_weight_transfer(self) -> WeightTransferJoined | None:
        """The answer of the join under way once it has settled, else None (cheap: the
        process loop calls it every iteration)."""
        if self.updater.joining is None:
            return None
        with self.lock:
            return self.updater.settle_join()

    @contextlib.contextmanager
    def live_weights(self, policy_version: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Mutate the served parameters in place (a trainer in this process), then publish the
        new version on exit. Holds the engine lock throughout; running requests continue on
        their KV (CONTINUE). Nothing is published if the block raises. Refused
        (WeightUpdateError, FAILED_PRECONDITION) on a model that keeps weights quantized (FP8
        projections, MXFP4 experts: engine/weights/in_format.py): their data is no weight to
        edit without its scales; update_weights quantizes what it is given."""
        if in_format(self.updater.model):
            why = "live_weights: this model keeps weights quantized in format; use update_weights"
            raise WeightUpdateError(ErrorCode.FAILED_PRECONDITION, why)
        with self.lock:
            self.loop.settle()
            with self.updater.live(policy_version) as params:
                yield params

    def start_sleep(self, msg: Sleep) -> None:
        """Accept a Sleep; its SleepOutcome goes to `sleeper.sink` (or `sleeper.events`)."""
        with self.lock:
            self.loop.settle()
            self.sleeper.start(msg)

    def wake(self, msg: Wake) -> None:
        with self.lock:
            self.sleeper.wake(msg)

    # ---- the in-process calls that wait for their outcome (engine/core/in_process.py) ----

    def update_weights(
        self,
        source: str | Path | Mapping[str, torch.Tensor],
        policy_version: int = 0,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
        drain_timeout: float | None = None,
    ) -> WeightsProgress:
        """An update from a checkpoint directory or named tensors, applied before it returns."""
        calls = (self.start_weight_update, self.updater, self._step_into_pending)
        update_id, how = self.table.next_id("in-process"), (inflight, drain_timeout)
        return in_process.update_weights(*calls, update_id, source, policy_version, *how)

    def sleep(
        self,
        level: int = 1,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
        drain_timeout: float | None = None,
    ) -> SleepOutcome:
        """Free the KV cache (level 1) and the weights too (level 2) until wake_up(), done
        before it returns."""
        calls = (self.start_sleep, self.sleeper, self._step_into_pending)
        sleep_id = self.table.next_id("in-process")
        return in_process.sleep(*calls, sleep_id, level, inflight, drain_timeout)

    def wake_up(self) -> SleepOutcome:
        """Serve again after sleep()."""
        return in_process.wake_up(self.wake, self.sleeper, self.table.next_id("in-process"))

    def join_weight_transfer(self, msg: InitWeightTransfer) -> WeightTransferJoined:
        """begin_weight_transfer, then wait for its answer."""
        calls = (self.begin_weight_transfer, self.settle_weight_transfer, self.updater)
        return in_process.join_weight_transfer(*calls, msg)

    def _step_into_pending(self) -> None:
        """One step whose outputs wait in the table for the caller's next step()."""
        # NOTE: not `pending += self.step()` in one: step() returns outputs that may hold the
        # old pending list itself, which would then be extended with its own items.
        outputs = list(self.step())
        self.table.pending += outputs
