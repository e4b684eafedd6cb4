"""gpt-oss's sharding table: the Llama family's (engine/models/sharding.py: q/k/v, o_proj,
the vocabulary) plus its own tensors, by the names its checkpoints use.

- `self_attn.sinks` [heads]: one learned logit per query head, split with the heads (rank r
  holds its query heads' sinks).
- `mlp.experts.gate_up_proj` [experts, hidden, 2 * inter], gate and up columns interleaved:
  split on the last dimension, rank r holding the columns of its slice of the intermediate
  dimension (each gate column beside its up column, so a contiguous range of pairs);
  `gate_up_proj_bias` [experts, 2 * inter] likewise.
- `mlp.experts.down_proj` [experts, inter, hidden]: split on the intermediate dimension;
  `down_proj_bias` whole (the rank that adds it is rank 0: engine/moe/experts.py).
- `mlp.router.weight` and `.bias`: whole (every rank routes every token).
"""

from __future__ import annotations

from engine.models.sharding import Sharding
from engine.parallel.shard_layout import Split


class GptOssSharding(Sharding):
    def split(self, name: str) -> Split | None:
        if self.size == 1:
            return None
        if name.endswith("self_attn.sinks"):
            return Split(
                0,
                self.rank * self.num_heads,
                (self.rank + 1) * self.num_heads,
                self.config.num_heads,
            )
        if ".mlp.experts." in name:
            start, length, full = self._ranges["expert"]
            tensor = name.rpartition(".")[2]
            if tensor == "gate_up_proj":
                return Split(2, 2 * start, 2 * (start + length), 2 * full)
            if tensor == "gate_up_proj_bias":
                return Split(1, 2 * start, 2 * (start + length), 2 * full)
            if tensor == "down_proj":
                return Split(1, start, start + length, full)
            return None  # down_proj_bias
        if ".mlp.router." in name:
            return None
        return super().split(name)

    def for_rank(self, rank: int) -> GptOssSharding:
        return GptOssSharding(self.config, rank, self.size)
