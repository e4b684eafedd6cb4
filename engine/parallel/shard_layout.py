"""ShardLayout: which slice of each checkpoint tensor one tensor-parallel rank holds, by name.

A model family's sharding table (engine/models/sharding.py for the Llama family) decides
`split` from the names its checkpoints use; loading, weight updates and LoRA slots cut tensors
through this interface only, so they never name a family's weights. The base layout holds
every tensor whole (one rank, or a source with no model to ask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Split:
    """This rank holds [start, stop) of dimension `dim`, whose full size is `full`."""

    dim: int
    start: int
    stop: int
    full: int

    def index(self) -> tuple[slice, ...]:
        return (*[slice(None)] * self.dim, slice(self.start, self.stop))


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
        return source[:] if split is None else source[split.index()]
