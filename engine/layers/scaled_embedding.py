"""ScaledEmbedding: a vocabulary-parallel embedding whose rows are multiplied by a constant.

Gemma's token embedding is scaled by sqrt(hidden_size) (Gemma 4's per-layer embedding by
sqrt(its width)). As transformers computes it, the constant is first rounded to the weights'
dtype (in bfloat16 sqrt(3072) = 55.4256 becomes 55.5), then multiplies each row in that dtype.
"""

from __future__ import annotations

import torch

from engine.layers.vocab_embedding import VocabParallelEmbedding
from engine.parallel.tensor_parallel import TensorParallel


class ScaledEmbedding(VocabParallelEmbedding):
    def __init__(
        self, vocab_local: int, hidden: int, start: int, tp: TensorParallel, scale: float
    ) -> None:
        super().__init__(vocab_local, hidden, start, tp)
        self.scale = scale
        self._rounded: dict[torch.dtype, float] = {}  # the scale as each dtype holds it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, hidden]
        h = super().forward(ids)
        if h.dtype not in self._rounded:  # a host-side constant: no device work, graph-safe
            self._rounded[h.dtype] = torch.tensor(self.scale, dtype=h.dtype).item()
        return h * self._rounded[h.dtype]
