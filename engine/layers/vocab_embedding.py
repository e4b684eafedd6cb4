"""VocabParallelEmbedding: the token embedding, its vocabulary rows split over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.tensor_parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + weight rows) of the embedding; other ids embed as zeros, and one
    all-reduce sums each token's single non-zero row."""

    def __init__(self, vocab_local: int, hidden: int, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden))
        self.start = start
        self.tp = tp
        nn.init.normal_(self.weight)  # as nn.Embedding, drawing from the RNG as it would

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, hidden]
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])  # no host sync: graph-safe
        h = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))
