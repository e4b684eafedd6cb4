"""The bucket layout of a distributed weight update: where each tensor's bytes sit in the flat
buffers a trainer broadcasts.

Tensors go in their listed order. A tensor starts at the next multiple of ALIGN bytes of its
bucket (so every dtype's view of it is aligned); a bucket takes tensors while they fit in
`bucket_bytes`, and a tensor larger than that goes alone into a bucket of its own size (never
split: a tensor is always one view of one buffer). The trainer side
(clients/python/sluice_client/weight_transfer.py) computes the same layout; the rule is part of
the public contract (DistributedSource in admin.proto). Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.protocol.messages import TensorSpec

ALIGN = 64
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class Placement:
    spec: TensorSpec
    offset: int  # bytes into its bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    nbytes: int  # the buffer's size: the end of its last tensor
    tensors: tuple[Placement, ...]


def bucket_layout(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """The buckets holding `specs` (dtypes must be ITEMSIZE's), in broadcast order."""
    assert bucket_bytes > 0
    buckets: list[Bucket] = []
    placed: list[Placement] = []
    end = 0
    for spec in specs:
        nbytes = math.prod(spec.shape) * ITEMSIZE[spec.dtype]
        offset = -(-end // ALIGN) * ALIGN
        if placed and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(end, tuple(placed)))
            placed, offset = [], 0
        placed.append(Placement(spec, offset, nbytes))
        end = offset + nbytes
    if placed:
        buckets.append(Bucket(end, tuple(placed)))
    return buckets
