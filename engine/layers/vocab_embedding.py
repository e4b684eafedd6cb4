"""VocabParallelEmbedding: the token embedding, its vocabulary rows split over the ranks."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.tensor_parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + weight rows) of the embedding; other ids embed as zeros, and one
    all-reduce sums each token's single non-zero row.

    `scale`, when given, multiplies every embedding (Gemma's sqrt(hidden_size)), as
    transformers' scaled embeddings do: the scale is rounded to float32 and then to the
    weights' dtype (in bfloat16 Gemma's sqrt(3072) is 55.5, not 55.43), and multiplies in
    that dtype."""

    def __init__(
        self,
        vocab_local: int,
        hidden: int,
        start: int,
        tp: TensorParallel,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden))
        self.start = start
        self.tp = tp
        self.scale = scale
        nn.init.normal_(self.weight)  # as nn.Embedding, drawing from the RNG as it would

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, hidden]
        if not self.tp.enabled:
            h = F.embedding(ids, self.weight)
        else:
            local = ids - self.start
            inside = (local >= 0) & (local < self.weight.shape[0])  # no host sync: graph-safe
            h = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
            h = self.tp.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))
        if self.scale is None:
            return h
        # Scaling after the all-reduce is exact: every row but one of the sum is zero.
        return h * rounded_scale(self.scale, h.dtype)


@functools.cache
def rounded_scale(scale: float, dtype: torch.dtype) -> float:
    """`scale` rounded as transformers rounds it (to float32, then to `dtype`). A Python
    number, not a tensor: no device copy in the forward (CUDA graphs). The product is the
    same: a value exact in `dtype` times a `dtype` tensor rounds once either way."""
    return float(torch.tensor(scale, dtype=torch.float32).to(dtype))
