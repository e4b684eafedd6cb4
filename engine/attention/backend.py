"""AttentionBackend: what a model's attention layers need of a paged-attention implementation.

Every backend of this package (torch_ref, cpu, triton) satisfies it; a model calls `prepare`
once per step and `forward` in each layer, with that layer's `KVCache`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from engine.layers.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V pages of one layer


class AttentionBackend(Protocol):
    """Paged attention: `prepare` once per step, then `forward` in every layer.

    `forward` rotates q and k at `positions` (`rotary`'s tables), writes k and v into the
    layer's cache at `meta.slot_mapping`, then returns each query's attention over its
    sequence's context; without a cache, over the new tokens only. The Triton backend does the
    first two in one kernel; torch_ref, the reference, calls `rotary` and `index_copy_`. A
    decode-only step must be capturable in a CUDA graph: no host syncs and no shapes that
    depend on tensor contents.
    """

    name: str

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: KVCache | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...
