"""TransferGroup: one engine rank's membership of a trainer's process group, the channel of
distributed weight updates.

The group is stateless, apart from the engine's own torch.distributed default group (tensor
parallelism): a client of the trainer's TCPStore, namespaced by a PrefixStore(group_name), and
a ProcessGroupGloo (or ProcessGroupNCCL) constructed directly on it. Tensor-parallel rank r
joins as rank_offset + r.

Joining never blocks the engine loop: `begin_all` starts every rank's join on a thread of its
own (engine/weights/group_join.py) and the loop keeps stepping; once rank 0's join has
settled (joined, failed, or out of its timeout) `finish_all` has every rank finish too, and
every rank is joined, or none stays joined. Every collective of the group waits at most its
timeout, so a trainer that dies or stalls fails the update instead of blocking the engine
loop for ever. A failed transfer leaves the group: its ranks no longer agree on what comes next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from engine.models.base import CausalLM
from engine.parallel.step_channel import Op, StepChannel, StepHeader
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import TransferGroupSpec
from engine.weights.group_join import MAX_ABANDONED, GroupJoin
from engine.weights.staging import WeightUpdateError


class TransferGroup:
    def __init__(self) -> None:
        self.spec: TransferGroupSpec | None = None
        self.device = torch.device("cpu")  # where received buckets live
        self.joining: GroupJoin | None = None  # a join under way
        self.on_done: Callable[[], None] | None = None  # wakes an idle loop when c10d returns
        self._abandoned: list[GroupJoin] = []
        self._group: Any = None
        self._store: Any = None

    @property
    def joined(self) -> bool:
        return self._group is not None

    def begin(self, spec: TransferGroupSpec, tp_rank: int, device: torch.device) -> None:
        """Leave any group held, then start joining `spec`'s as rank rank_offset + tp_rank; a
        join refused at once (a backend this device cannot use: INVALID_ARGUMENT; too many
        earlier joins still blocked: UNAVAILABLE) settles failed."""
        self.leave()
        rank = spec.rank_offset + tp_rank
        self._abandoned = [j for j in self._abandoned if j.blocked]
        failed = None
        if spec.backend == "nccl" and device.type != "cuda":
            failed = WeightUpdateError(
                ErrorCode.INVALID_ARGUMENT,
                f"backend 'nccl' needs a CUDA engine; this one runs on {device}",
            )
        elif len(self._abandoned) >= MAX_ABANDONED:
            failed = WeightUpdateError(
                ErrorCode.UNAVAILABLE,
                f"{len(self._abandoned)} earlier joins are still waiting for their stores to "
                "answer: try again once they give up (c10d ends them when the peer closes)",
            )
        self.joining = GroupJoin(spec, rank, device, self.on_done, failed)

    def finish(self, wait: float) -> None:
        """Wait up to `wait` seconds for the join under way, then hold its group, or abandon
        it and raise its WeightUpdateError."""
        joining, self.joining = self.joining, None
        assert joining is not None
        joining.wait(wait)
        try:
            membership = joining.membership()
        except WeightUpdateError:
            if joining.abandon():
                self._abandoned.append(joining)
            raise
        self.spec = joining.spec
        self.device = joining.device if joining.spec.backend == "nccl" else torch.device("cpu")
        self._group, self._store = membership.group, membership.store

    def receive(self, buffer: torch.Tensor) -> None:
        """Group rank 0's broadcast into `buffer`; RuntimeError if it fails or times out."""
        assert self._group is not None
        self._group.broadcast(buffer, 0).wait()

    def leave(self) -> None:
        """Leave the group held, and abandon a join under way (its late group is dropped)."""
        if self.joining is not None:
            joining, self.joining = self.joining, None
            if joining.abandon():
                self._abandoned.append(joining)
        group, self._group, self._store, self.spec = self._group, None, None, None
        if group is not None and hasattr(group, "abort"):  # NCCL: free its communicators now
            with contextlib.suppress(RuntimeError):
                group.abort()


def begin_all(
    model: CausalLM,
    transfer: TransferGroup,
    spec: TransferGroupSpec,
    channel: StepChannel | None,
) -> None:
    """Rank 0: every tensor-parallel rank starts joining `spec`'s group; returns at once."""
    if model.tp.enabled:
        assert channel is not None
        channel.send(StepHeader(Op.JOIN))
        model.tp.broadcast_object(spec)
    transfer.begin(spec, model.tp.rank, _device(model))


def finish_all(model: CausalLM, transfer: TransferGroup, channel: StepChannel | None) -> None:
    """Rank 0, once its join has settled: every rank finishes its join; if any failed, every
    rank leaves and rank 0 raises that rank's WeightUpdateError."""
    failure = _finish_here(model, transfer, 0.0)
    if model.tp.enabled:
        assert channel is not None
        channel.send(StepHeader(Op.JOINED))
        model.tp.broadcast_object(failure is None)
    _agree(model, transfer, failure)


def leave_all(model: CausalLM, transfer: TransferGroup, channel: StepChannel | None) -> None:
    """Rank 0: every rank leaves the group (and abandons a join under way)."""
    if model.tp.enabled:
        assert channel is not None
        channel.send(StepHeader(Op.JOIN))
        model.tp.broadcast_object(None)
    transfer.leave()


def follow_join(model: CausalLM, transfer: TransferGroup) -> None:
    """A worker, after Op.JOIN: start joining (or leave) with rank 0."""
    spec: TransferGroupSpec | None = model.tp.broadcast_object()
    if spec is None:
        transfer.leave()
    else:
        transfer.begin(spec, model.tp.rank, _device(model))


def follow_joined(model: CausalLM, transfer: TransferGroup) -> None:
    """A worker, after Op.JOINED: rank 0 joined (wait for this rank's join, at most its
    deadline) or gave up (give up too), then agree."""
    rank0_joined: bool = model.tp.broadcast_object()
    joining = transfer.joining
    wait = joining.due_in() if joining is not None and rank0_joined else 0.0
    with contextlib.suppress(WeightUpdateError):  # rank 0 reports it
        _agree(model, transfer, _finish_here(model, transfer, wait))


def _finish_here(
    model: CausalLM, transfer: TransferGroup, wait: float
) -> tuple[int, str, str] | None:
    try:
        transfer.finish(wait)
    except WeightUpdateError as exc:
        return (model.tp.rank, exc.code, exc.message)
    return None


def _agree(model: CausalLM, transfer: TransferGroup, failure: tuple[int, str, str] | None) -> None:
    tp = model.tp
    failures = [f for f in tp.all_gather_object(failure) if f is not None] if tp.enabled else []
    failures = failures or ([failure] if failure is not None else [])
    if failures:
        transfer.leave()
        rank, code, message = failures[0]
        raise WeightUpdateError(code, message if rank == 0 else f"rank {rank}: {message}")


def _device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device
