"""Weight updates over every tensor-parallel rank: all ranks swap at one step boundary, or none.

Rank 0 (WeightUpdater) sends Op.STAGE, then broadcasts the update's source: a checkpoint
directory or a tensor file (each rank reads its own slices from it), in-process tensors
(broadcast whole, one at a time; each rank keeps its slice), or a distributed update's list
(each rank receives every bucket from the trainer itself; engine/weights/distributed.py), over
the UpdateTarget's tensors (the model's, and a speculative draft model's). Every rank stages
and validates its shard, then one all-gather of the verdicts decides: if any rank failed,
every rank drops what it staged and rank 0 fails the update with that rank's reason; otherwise
the workers swap at once and rank 0 swaps in WeightUpdater, before its next step reaches them.

`gather_parameters` is the other direction, for live_weights: the whole of every checkpoint
tensor (by its checkpoint name, q/k/v and gate/up apart), assembled on rank 0 from every rank's
shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.models.base import CausalLM
from engine.parallel.shard_layout import ShardLayout
from engine.parallel.step_channel import Op, StepChannel, StepHeader
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import DistributedTensors, TensorRef
from engine.weights.distributed import stage_distributed
from engine.weights.in_format import InFormatTensors
from engine.weights.staging import (
    Progress,
    StagedWeights,
    WeightUpdateError,
    stage_checkpoint,
    stage_tensor_file,
    stage_tensors,
)
from engine.weights.transfer_group import TransferGroup
from engine.weights.update_target import UpdateTarget


@dataclass(frozen=True)
class UpdateSource:
    """Where an update's tensors are, as every rank can read it (plain data)."""

    checkpoint_dir: str | None = None
    tensor_file: str | None = None
    refs: tuple[TensorRef, ...] = ()
    tensors: tuple[tuple[str, tuple[int, ...], str], ...] | None = None  # name, shape, dtype
    distributed: DistributedTensors | None = None  # every rank receives it from the trainer


def stage(
    target: UpdateTarget,
    source: UpdateSource,
    progress: Progress,
    tensors: Mapping[str, torch.Tensor] | None = None,
    channel: StepChannel | None = None,
    transfer: TransferGroup | None = None,
) -> StagedWeights:
    """Stage this rank's shard of `source`; with a channel (rank 0 of a group) on every rank.
    Raises WeightUpdateError unless every rank staged its shard. `transfer`: this rank's
    membership of the trainer's group (a distributed source); a failed distributed update
    leaves it on every rank."""
    target = target.for_source(source.checkpoint_dir)
    params, kept = target.checkpoint_tensors(), target.in_format()
    tp, sharding = target.tp, target.sharding
    if not tp.enabled:
        return _stage_here(params, sharding, kept, source, progress, tensors, transfer)
    if tp.rank == 0:
        assert channel is not None
        channel.send(StepHeader(Op.STAGE))
        tp.broadcast_object(source)
    staged: StagedWeights | None = None
    failure: tuple[int, str, str] | None = None
    try:
        if source.tensors is not None:
            staged = _stage_broadcast(target, source, tensors)
        else:
            staged = _stage_here(params, sharding, kept, source, progress, None, transfer)
    except WeightUpdateError as exc:
        failure = (tp.rank, exc.code, exc.message)
    failures = [f for f in tp.all_gather_object(failure) if f is not None]
    if failures:
        if source.distributed is not None and transfer is not None:
            transfer.leave()  # the ranks no longer agree on the group's next broadcast
        rank, code, message = failures[0]
        raise WeightUpdateError(code, message if rank == 0 else f"rank {rank}: {message}")
    assert staged is not None
    return staged


def follow_stage(target: UpdateTarget, transfer: TransferGroup) -> None:
    """A worker, after Op.STAGE: stage with rank 0, and swap if every rank succeeded."""
    source: UpdateSource = target.tp.broadcast_object()
    try:
        staged = stage(target, source, lambda done, count: None, transfer=transfer)
    except WeightUpdateError:
        return  # rank 0 reports it; nothing changed here
    staged.apply()


def _stage_here(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout,
    kept: InFormatTensors,
    source: UpdateSource,
    progress: Progress,
    tensors: Mapping[str, torch.Tensor] | None,
    transfer: TransferGroup | None,
) -> StagedWeights:
    if tensors is not None:
        return stage_tensors(params, sharding, tensors, kept)
    if source.distributed is not None:
        assert transfer is not None
        return stage_distributed(params, sharding, transfer, source.distributed, progress, kept)
    if source.checkpoint_dir is not None:
        return stage_checkpoint(params, sharding, source.checkpoint_dir, progress, kept)
    if source.tensor_file is not None:
        refs = source.refs
        return stage_tensor_file(params, sharding, source.tensor_file, refs, progress, kept)
    raise WeightUpdateError(ErrorCode.INVALID_ARGUMENT, "the update names no source")


def _stage_broadcast(
    target: UpdateTarget, source: UpdateSource, tensors: Mapping[str, torch.Tensor] | None
) -> StagedWeights:
    """In-process tensors: rank 0 broadcasts each whole tensor; every rank stages its slice.
    NOTE: every tensor is broadcast even after a bad one: the ranks must make the same
    collectives; the first failure is raised at the end."""
    assert source.tensors is not None
    staged = StagedWeights(target.checkpoint_tensors(), target.sharding, target.in_format())
    first: WeightUpdateError | None = None
    for name, shape, dtype in source.tensors:
        if tensors is not None:  # rank 0
            whole = tensors[name].detach().to("cpu").contiguous()
        else:
            whole = torch.empty(shape, dtype=getattr(torch, dtype))
        # NOTE: FP8 travels as its bytes (gloo has no float8 type).
        target.tp.broadcast(whole.view(torch.uint8) if whole.element_size() == 1 else whole)
        try:
            staged.add(name, whole, shape, cast=False)
            staged.own(name)  # not a view of `whole`
        except WeightUpdateError as exc:
            first = first or exc
    if first is not None:
        raise first
    staged.finish()
    return staged


def describe(
    checkpoint_dir: str | None,
    tensor_file: str | None,
    refs: tuple[TensorRef, ...],
    tensors: Mapping[str, torch.Tensor] | None,
    distributed: DistributedTensors | None = None,
) -> UpdateSource:
    specs = None
    if tensors is not None:
        specs = tuple(
            (name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in tensors.items()
        )
    return UpdateSource(checkpoint_dir, tensor_file, refs, specs, distributed)


def gather_parameters(
    model: CausalLM, channel: StepChannel | None = None
) -> dict[str, torch.Tensor]:
    """Rank 0: every checkpoint tensor whole (copies, by checkpoint name), assembled from every
    rank's shard; a worker (after Op.GATHER) sends its shards and gets {}."""
    tp = model.tp
    if tp.rank == 0 and channel is not None:
        channel.send(StepHeader(Op.GATHER))
    shards = [model.sharding.for_rank(r) for r in range(tp.size)]
    whole: dict[str, torch.Tensor] = {}
    for name, param in model.checkpoint_tensors().items():
        local = param.to("cpu").contiguous()
        parts = [torch.empty_like(local) for _ in range(tp.size)] if tp.rank == 0 else None
        dist.gather(local, parts, dst=0, group=tp.control)
        if parts is None:
            continue
        full = torch.empty(model.sharding.full_shape(name, tuple(local.shape)), dtype=local.dtype)
        for shard, part in zip(shards, parts, strict=True):
            split = shard.split(name)
            if split is None:
                full.copy_(part)
            else:
                split.place(full, part)
        whole[name] = full.to(param.device)
    return whole
