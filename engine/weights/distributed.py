"""Staging a distributed weight update: the tensors a trainer broadcasts over the transfer group.

Every rank receives every bucket (engine/weights/buckets.py has the layout) into a fresh
buffer of its size and stages its slice of each tensor in it, checked like any other source;
nothing touches the served weights until the caller swaps. A bucket that does not arrive
within the group's timeout, or whose broadcast fails (the trainer died), fails the update
ABORTED and leaves the group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.parallel.shard_layout import ShardLayout
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import DistributedTensors
from engine.weights.buckets import bucket_layout
from engine.weights.in_format import InFormatTensors
from engine.weights.staging import DTYPES, Progress, StagedWeights, WeightUpdateError
from engine.weights.transfer_group import TransferGroup


def stage_distributed(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout | None,
    transfer: TransferGroup,
    source: DistributedTensors,
    progress: Progress,
    kept: InFormatTensors | None = None,
) -> StagedWeights:
    if not transfer.joined:
        raise WeightUpdateError(
            ErrorCode.FAILED_PRECONDITION, "no weight-transfer group: call InitWeightTransfer first"
        )
    staged = StagedWeights(params, sharding, kept)
    buckets = bucket_layout(source.tensors, source.bucket_bytes)
    done = 0
    for n, bucket in enumerate(buckets):
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=transfer.device)
        try:
            transfer.receive(buffer)
        except RuntimeError as exc:
            transfer.leave()
            raise WeightUpdateError(
                ErrorCode.ABORTED,
                f"the weight transfer failed at bucket {n + 1} of {len(buckets)}: {exc}; "
                "nothing changed, and the engine left the group: call InitWeightTransfer again",
            ) from exc
        for placed in bucket.tensors:
            spec = placed.spec
            raw = buffer[placed.offset : placed.offset + placed.nbytes]
            whole = raw.view(DTYPES[spec.dtype]).view(spec.shape)
            staged.add(spec.name, whole, spec.shape, cast=False)
            staged.own(spec.name)  # NOTE: not pinning the whole bucket
            done += staged.nbytes_of(spec.name)
            progress(done, staged.count)
        del buffer
    staged.finish()
    return staged
