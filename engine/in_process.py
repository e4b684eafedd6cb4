"""The in-process admin calls of LLMEngine that wait for their outcome: a weight update, a
sleep, a wake. Each sends the same message the engine process sends for its service (so the
same state machines, WeightUpdater and Sleeper, run it) and steps the engine until it is done;
the outputs of those steps wait in `pending` for the caller's next step().
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from engine.protocol.messages import (
    InflightPolicy,
    Sleep,
    SleepOutcome,
    UpdateWeights,
    Wake,
    WeightsProgress,
)
from engine.sleep.sleeper import Sleeper
from engine.weights.weight_updater import WeightUpdater


class Engine(Protocol):
    """What these calls use of LLMEngine."""

    updater: WeightUpdater
    sleeper: Sleeper
    _arrivals: itertools.count[int]

    def start_weight_update(
        self, msg: UpdateWeights, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> None: ...
    def start_sleep(self, msg: Sleep) -> None: ...
    def wake(self, msg: Wake) -> None: ...
    def _step_into_pending(self) -> None: ...


def update_weights(
    engine: Engine,
    source: str | Path | Mapping[str, torch.Tensor],
    policy_version: int = 0,
    inflight: InflightPolicy = InflightPolicy.DRAIN,
    drain_timeout: float | None = None,
) -> WeightsProgress:
    """In-process update from a checkpoint directory or named tensors; returns APPLIED or
    raises WeightUpdateError (FAILED_PRECONDITION: the version is not above the served
    one or another update is in progress; OUT_OF_RANGE: it would pass MAX_POLICY_VERSION;
    INVALID_ARGUMENT: bad tensors). DRAIN steps running requests to completion first:
    their outputs are returned by the next step()."""
    tensors = None if isinstance(source, str | Path) else source
    msg = UpdateWeights(
        update_id=f"in-process-{next(engine._arrivals)}",
        policy_version=policy_version,
        inflight=inflight,
        checkpoint_dir=str(source) if tensors is None else None,
        drain_timeout=drain_timeout,
    )
    engine.start_weight_update(msg, tensors)
    while engine.updater.is_pending(msg):
        engine._step_into_pending()
    return engine.updater.outcome(msg)


def sleep(
    engine: Engine,
    level: int = 1,
    inflight: InflightPolicy = InflightPolicy.DRAIN,
    drain_timeout: float | None = None,
) -> SleepOutcome:
    """Free the KV cache and the prefix cache (level 1), and the weights too (level 2),
    until wake_up(). DRAIN steps every request in the engine to completion first (their
    outputs are returned by the next step()); ABORT ends them ABORTED. Raises SleepError
    (INVALID_ARGUMENT: a bad level or policy; FAILED_PRECONDITION: an update or a sleep is
    in progress, or tensor parallelism; ABORTED: the drain timed out, nothing changed)."""
    msg = Sleep(f"in-process-{next(engine._arrivals)}", level, inflight, drain_timeout)
    engine.start_sleep(msg)
    while engine.sleeper.in_progress:
        engine._step_into_pending()
    return engine.sleeper.outcome(msg.sleep_id)


def wake_up(engine: Engine) -> SleepOutcome:
    """Serve again after sleep(): the same KV pages; after level 2 the weights are read
    again from their origin (the served checkpoint, or the last checkpoint update and the
    tensor files after it) unless an update that set every tensor restored them. Raises
    SleepError FAILED_PRECONDITION (still asleep) when they cannot be read again."""
    msg = Wake(f"in-process-{next(engine._arrivals)}")
    engine.wake(msg)
    return engine.sleeper.outcome(msg.sleep_id)
