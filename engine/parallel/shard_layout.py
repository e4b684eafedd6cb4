"""ShardLayout: which slice of each checkpoint tensor one tensor-parallel rank holds, by name.

A model family's sharding table (engine/models/sharding.py for the Llama family) decides
`split` from the names its checkpoints use; loading, weight updates and LoRA slots cut tensors
through this interface only, so they never name a family's weights. The base layout holds
every tensor whole (one rank, or a source with no model to ask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Split:
    """This rank holds [start, stop) of dimension `dim`, whose full size is `full`.

    A fused tensor (several projections stacked along `dim` in the checkpoint, as Phi-3's
    qkv_proj: q rows, then k, then v) is split projection by projection: the rank holds its
    range of each, concatenated in order; `rest` are the ranges after the first.
    """

    dim: int
    start: int
    stop: int
    full: int
    rest: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.stop), *self.rest)

    def index(self) -> tuple[slice, ...]:
        """The first range's index: this rank's whole part, unless the tensor is fused."""
        return self._at(self.start, self.stop)

    def _at(self, start: int, stop: int) -> tuple[slice, ...]:
        return (*[slice(None)] * self.dim, slice(start, stop))

    def take(self, source: Any) -> Any:
        """This rank's part of a whole tensor (or of a safetensors slice, which reads only
        these rows or columns)."""
        if not self.rest:
            return source[self.index()]
        return torch.cat([source[self._at(a, b)] for a, b in self.ranges], dim=self.dim)

    def place(self, whole: Any, part: Any) -> None:
        """Write this rank's `part` into `whole` where `take` reads it from."""
        offset = 0
        for a, b in self.ranges:
            whole[self._at(a, b)] = part[self._at(offset, offset + b - a)]
            offset += b - a


class ShardLayout:
    """Rank `rank` of `size`: every tensor whole unless a family's table overrides `split`."""

    rank: int = 0
    size: int = 1

    def split(self, name: str) -> Split | None:
        """This rank's slice of parameter `name`; None when every rank holds it whole."""
        return None

    def for_rank(self, rank: int) -> ShardLayout:
        """The same model's layout on rank `rank` of the same group."""
        return self

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint shape of a parameter whose shard on this rank has shape `local`."""
        split = self.split(name)
        if split is None:
            return tuple(local)
        shape = list(local)
        shape[split.dim] = split.full
        return tuple(shape)

    def take(self, name: str, source: Any) -> Any:
        """This rank's part of a whole tensor: `source` is anything indexable like a tensor
        (a torch tensor, a safetensors slice, which then reads only these rows or columns)."""
        split = self.split(name)
        return source[:] if split is None else split.take(source)
