"""The in-process admin calls of LLMEngine that wait for their outcome: a weight update, a
sleep, a wake, a join of a trainer's process group. Each sends the same message the engine
process sends for its service (so the same state machines, WeightUpdater and Sleeper, run it)
and steps the engine until it is done; the outputs of those steps wait in the RequestTable's
pending outputs for the caller's next step(). LLMEngine passes each what it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from engine.protocol.messages import (
    InflightPolicy,
    InitWeightTransfer,
    Sleep,
    SleepOutcome,
    UpdateWeights,
    Wake,
    WeightsProgress,
    WeightTransferJoined,
)
from engine.sleep.sleeper import Sleeper
from engine.weights.weight_updater import WeightUpdater

Tensors = Mapping[str, torch.Tensor]
StepIntoPending = Callable[[], None]  # one step whose outputs wait for the next step()


def update_weights(
    start: Callable[[UpdateWeights, Tensors | None], None],
    updater: WeightUpdater,
    step_into_pending: StepIntoPending,
    update_id: str,
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
        update_id=update_id,
        policy_version=policy_version,
        inflight=inflight,
        checkpoint_dir=str(source) if tensors is None else None,
        drain_timeout=drain_timeout,
    )
    start(msg, tensors)
    while updater.is_pending(msg):
        step_into_pending()
    return updater.outcome(msg)


def sleep(
    start: Callable[[Sleep], None],
    sleeper: Sleeper,
    step_into_pending: StepIntoPending,
    sleep_id: str,
    level: int = 1,
    inflight: InflightPolicy = InflightPolicy.DRAIN,
    drain_timeout: float | None = None,
) -> SleepOutcome:
    """Free the KV cache and the prefix cache (level 1), and the weights too (level 2),
    until wake_up(). DRAIN steps every request in the engine to completion first (their
    outputs are returned by the next step()); ABORT ends them ABORTED. Raises SleepError
    (INVALID_ARGUMENT: a bad level or policy; FAILED_PRECONDITION: an update or a sleep is
    in progress, or tensor parallelism; ABORTED: the drain timed out, nothing changed)."""
    msg = Sleep(sleep_id, level, inflight, drain_timeout)
    start(msg)
    while sleeper.in_progress:
        step_into_pending()
    return sleeper.outcome(msg.sleep_id)


def wake_up(wake: Callable[[Wake], None], sleeper: Sleeper, sleep_id: str) -> SleepOutcome:
    """Serve again after sleep(): the same KV pages; after level 2 the weights are read
    again from their origin (the served checkpoint, or the last checkpoint update and the
    tensor files after it) unless an update that set every tensor restored them. Raises
    SleepError FAILED_PRECONDITION (still asleep) when they cannot be read again."""
    msg = Wake(sleep_id)
    wake(msg)
    return sleeper.outcome(msg.sleep_id)


def join_weight_transfer(
    begin: Callable[[InitWeightTransfer], WeightTransferJoined | None],
    settle: Callable[[], WeightTransferJoined | None],
    updater: WeightUpdater,
    msg: InitWeightTransfer,
) -> WeightTransferJoined:
    """`begin` the join, then wait for its answer (`settle`: the engine's, under its lock)."""
    answer = begin(msg)
    while answer is None:
        joining = updater.transfer.joining
        if joining is not None:
            joining.wait(joining.due_in())
        answer = settle()
    return answer
