"""TransferGroup: one engine rank's membership of a trainer's process group, the channel of
distributed weight updates.

The group is stateless, apart from the engine's own torch.distributed default group (tensor
parallelism): a client of the trainer's TCPStore, namespaced by a PrefixStore(group_name), and
a ProcessGroupGloo (or ProcessGroupNCCL) constructed directly on it. Tensor-parallel rank r
joins as rank_offset + r; every rank joins, or none stays joined (`join`, with the workers'
`follow_join`). Every collective of the group waits at most its timeout, so a trainer that
dies or stalls fails the update instead of blocking the engine loop for ever. A failed
transfer leaves the group: its ranks no longer agree on what comes next.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist

from engine.messages import TransferGroupSpec
from engine.models.llama import LlamaForCausalLM
from engine.parallel.step_channel import Op, StepChannel, StepHeader
from engine.weights.staging import WeightUpdateError


class TransferGroup:
    def __init__(self) -> None:
        self.spec: TransferGroupSpec | None = None
        self.device = torch.device("cpu")  # where received buckets live
        self._group: Any = None
        self._store: Any = None

    @property
    def joined(self) -> bool:
        return self._group is not None

    def join(self, spec: TransferGroupSpec, tp_rank: int, device: torch.device) -> None:
        """Leave any group held, then join `spec`'s as rank rank_offset + tp_rank (blocks until
        every rank has, at most spec.timeout). WeightUpdateError: INVALID_ARGUMENT (a backend
        this device cannot use), UNAVAILABLE (no rendezvous in time)."""
        self.leave()
        if spec.backend == "nccl" and device.type != "cuda":
            raise WeightUpdateError(
                "INVALID_ARGUMENT", f"backend 'nccl' needs a CUDA engine; this one runs on {device}"
            )
        rank = spec.rank_offset + tp_rank
        timeout = datetime.timedelta(seconds=spec.timeout)
        where = f"{spec.master_address}:{spec.master_port}"
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
                "UNAVAILABLE",
                f"could not join the weight-transfer group {spec.group_name!r} at {where} as "
                f"rank {rank} of {spec.world_size} within {spec.timeout:g} s: {exc}",
            ) from exc
        self.spec, self.device = spec, device if spec.backend == "nccl" else torch.device("cpu")
        self._group, self._store = group, store

    def receive(self, buffer: torch.Tensor) -> None:
        """Group rank 0's broadcast into `buffer`; RuntimeError if it fails or times out."""
        assert self._group is not None
        self._group.broadcast(buffer, 0).wait()

    def leave(self) -> None:
        group, self._group, self._store, self.spec = self._group, None, None, None
        if group is not None and hasattr(group, "abort"):  # NCCL: free its communicators now
            with contextlib.suppress(RuntimeError):
                group.abort()


def join_all(
    model: LlamaForCausalLM,
    transfer: TransferGroup,
    spec: TransferGroupSpec | None,
    channel: StepChannel | None,
) -> None:
    """Rank 0: every tensor-parallel rank joins `spec`'s group (None: leaves); if any rank
    fails, every rank leaves and rank 0 raises that rank's WeightUpdateError."""
    if model.tp.enabled:
        assert channel is not None
        channel.send(StepHeader(Op.JOIN))
        model.tp.broadcast_object(spec)
    _join_here(model, transfer, spec)


def follow_join(model: LlamaForCausalLM, transfer: TransferGroup) -> None:
    """A worker, after Op.JOIN: join (or leave) with rank 0."""
    spec: TransferGroupSpec | None = model.tp.broadcast_object()
    with contextlib.suppress(WeightUpdateError):  # rank 0 reports it
        _join_here(model, transfer, spec)


def _join_here(
    model: LlamaForCausalLM, transfer: TransferGroup, spec: TransferGroupSpec | None
) -> None:
    tp = model.tp
    failure: tuple[int, str, str] | None = None
    try:
        if spec is None:
            transfer.leave()
        else:
            transfer.join(spec, tp.rank, next(model.parameters()).device)
    except WeightUpdateError as exc:
        failure = (tp.rank, exc.code, exc.message)
    failures = [f for f in tp.all_gather_object(failure) if f is not None] if tp.enabled else []
    failures = failures or ([failure] if failure is not None else [])
    if failures:
        transfer.leave()
        rank, code, message = failures[0]
        raise WeightUpdateError(code, message if rank == 0 else f"rank {rank}: {message}")
