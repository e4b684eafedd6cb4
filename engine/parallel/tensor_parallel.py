"""TensorParallel: one rank's place in the tensor-parallel group, and the collectives it runs.

Two process groups: `group` runs the forward's collectives on the model's device (NCCL on CUDA,
gloo on the CPU); `control` (gloo, host tensors) carries what rank 0 tells the other ranks (step
inputs, weight-update sources, verdicts). On the CPU both are the one gloo group. With one rank
nothing here touches torch.distributed and every collective is the identity.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A collective that waits longer than this fails (a hung or lost rank), on every backend.
# Rank 0 pings idle workers well within it (engine/parallel/worker_group.py), and the service's
# stall timeout usually ends a hung engine sooner.
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # device collectives (all-reduce, all-gather)
    control: Any = None  # gloo: rank 0 -> workers

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over every rank, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, vocab / size] on every rank -> [rows, vocab], rank r's slice at r."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's host tensor `x` into every rank's `x` (same shape and dtype)."""
        dist.broadcast(x, src=0, group=self.control)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's picklable `obj`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out


def rendezvous_store(size: int) -> Any:
    """Rank 0's rendezvous store on a free port of 127.0.0.1 (`store.port`), made before the
    workers start so they know where to join."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
    )


def join_group(rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
    """A worker: join the group whose store rank 0 serves on 127.0.0.1:`port`."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    return init_rank(store, rank, size, device)


def init_rank(store: Any, rank: int, size: int, device: torch.device) -> TensorParallel:
    """Join the process group (blocks until every rank has)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return TensorParallel(rank, size, dist.group.WORLD, control or dist.group.WORLD)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
