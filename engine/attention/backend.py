"""AttentionBackend: what a model's attention layers need of a paged-attention implementation.

Every backend of this package (torch_ref, cpu, triton) satisfies it; a model calls `prepare`
once per step and `forward` in each layer, with that layer's `KVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from engine.layers.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V pages of one layer


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, beyond plain causal attention over its whole context.

    Every field at its default is plain causal attention at the backend's scale (the Llama
    family's layers pass no LayerAttention at all). A layer's learned sinks (gpt-oss) are a
    parameter of the model, so they travel beside this, as `forward`'s `sinks`.
    """

    sliding_window: int | None = None  # a query at position i sees keys j with i - j < W
    scale: float | None = None  # softmax scale; None: the backend's (1 / sqrt(head_dim))
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.scale is None and self.softcap is None


FULL = LayerAttention()


class AttentionBackend(Protocol):
    """Paged attention: `prepare` once per step, then `forward` in every layer.

    `forward` rotates q and k at `positions` (`rotary`'s tables), writes k and v into the
    layer's cache at `meta.slot_mapping`, then returns each query's attention over its
    sequence's context; without a cache, over the new tokens only. The Triton backend does the
    first two in one kernel; torch_ref, the reference, calls `rotary` and `index_copy_`. A
    decode-only step must be capturable in a CUDA graph: no host syncs and no shapes that
    depend on tensor contents.

    `layer` says how the layer attends (a sliding window, its own scale, soft-capped scores);
    `sinks` [heads] (this rank's heads), when given, is a learned logit per head that joins
    every query's softmax as one more column whose value is zero: it only takes probability
    mass away from the keys (gpt-oss).
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
        layer: LayerAttention = FULL,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
