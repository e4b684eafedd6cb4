"""TrainerGroup: the trainer's side of a weight-transfer process group (rank 0), with torch.

It hosts the group's TCPStore (is_master), joins as rank 0 of a stateless ProcessGroupGloo (or
ProcessGroupNCCL) built on a PrefixStore(group_name) of it, apart from any default group the
trainer has, and broadcasts tensors packed into buckets by the server's layout: in the listed
order, each tensor's bytes at the next multiple of 64 bytes of its bucket, a bucket taking
tensors while they fit in `bucket_bytes`, and a tensor larger than that alone in a bucket of
its own size (admin.proto, DistributedSource). torch is imported when a group is made.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Sequence
from typing import Any

ALIGN = 64
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}

# One bucket: its size in bytes, and (index into the list, byte offset) of each tensor in it.
Bucket = tuple[int, list[tuple[int, int]]]


def dtype_name(tensor: Any) -> str:
    """The safetensors name of a torch tensor's dtype (F32, F16, BF16); ValueError otherwise."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name}: only {', '.join(DTYPE_NAMES)} tensors can be sent")
    return DTYPE_NAMES[name]


def bucket_layout(specs: Sequence[tuple[str, Sequence[int]]], bucket_bytes: int) -> list[Bucket]:
    """The buckets of tensors given as (dtype name, shape), in order."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes: must be >= 1")
    buckets: list[Bucket] = []
    placed: list[tuple[int, int]] = []
    end = 0
    for index, (dtype, shape) in enumerate(specs):
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        offset = -(-end // ALIGN) * ALIGN
        if placed and offset + nbytes > bucket_bytes:
            buckets.append((end, placed))
            placed, offset = [], 0
        placed.append((index, offset))
        end = offset + nbytes
    if placed:
        buckets.append((end, placed))
    return buckets


class TrainerGroup:
    """Rank 0 of a weight-transfer group. `port` 0 picks a free one (then read `port`)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        world_size: int,
        group_name: str,
        timeout: float,
        backend: str = "gloo",
    ) -> None:
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")
        self.backend = backend
        self.world_size = world_size
        self.group_name = group_name
        self.timeout = datetime.timedelta(seconds=timeout)
        self._store: Any = dist.TCPStore(
            host, port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self.port: int = self._store.port
        self._group: Any = None

    def join(self) -> None:
        """Join as rank 0; blocks until every rank has (at most the timeout)."""
        import torch.distributed as dist

        prefixed = dist.PrefixStore(self.group_name, self._store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._group = dist.ProcessGroupNCCL(prefixed, 0, self.world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(prefixed, 0, self.world_size, self.timeout)

    def broadcast(self, tensors: Sequence[Any], bucket_bytes: int) -> None:
        """Pack `tensors` into buckets and broadcast each; RuntimeError if a broadcast fails."""
        import torch

        if self._group is None:
            raise RuntimeError("the group is not joined")
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        )
        flat = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
        specs = [(dtype_name(t), tuple(t.shape)) for t in tensors]
        for nbytes, placed in bucket_layout(specs, bucket_bytes):
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            for index, offset in placed:
                part = flat[index]
                buffer[offset : offset + part.numel()].copy_(part)
            self._group.broadcast(buffer, 0).wait()

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and hasattr(group, "abort"):  # NCCL: free its communicators
            with contextlib.suppress(RuntimeError):  # already broken: nothing more to free
                group.abort()
        self._store = None
