"""Paged attention in Triton: the fast backend on CUDA.

Kernels over the PagePool layout (per layer: [pages, page_size, kv_heads, head_dim],
contiguous):
- engine/layers/rotary_kv.py's kernel first: rotary on q and k, and each new token's K and V
  into its cache slot (`meta.slot_mapping`).
- decode-only steps: triton_decode.py (split over the context, then reduce).
- prefill and mixed steps: triton_prefill.py (ragged queries, causal through the page table).

Every layer kind runs in the kernels: a sliding window (only the keys it sees are read), the
layer's own scale, a soft cap and learned sinks, as compile-time constants of each launch
(triton_scores.py). Shapes come from the tensors, so layers of one model may differ in head
size (Gemma 4: 256 and 512).

Only long-standing `tl` APIs (the H200 machine runs Triton 3.6). The kernels also run under
Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from engine.attention.backend import FULL, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchRefAttention
from engine.attention.triton_decode import decode
from engine.attention.triton_prefill import prefill
from engine.attention.triton_scores import block_n, kind_constants
from engine.layers.kernel_choice import interpreting
from engine.layers.rotary_kv import rotary_kv

if TYPE_CHECKING:
    from engine.layers.rope import RotaryEmbedding

__all__ = ["TritonPagedAttention", "interpreting"]

MAX_SPLITS = 16


class TritonPagedAttention:
    """The AttentionBackend of Triton kernels; same contract as TorchRefAttention."""

    name = "triton"

    def __init__(self, scale: float, page_size: int, num_programs: int = 264) -> None:
        self.scale = scale
        self.page_size = page_size
        self.num_programs = num_programs  # decode programs to aim for (about 2 per SM)
        self._dense = TorchRefAttention(scale, page_size)  # no-cache forwards only

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to derive: the kernels read the metadata's tensors directly."""

    def num_splits(self, num_seqs: int, kv_heads: int, window_blocks: int = MAX_SPLITS) -> int:
        """KV splits of a decode step: enough programs to fill the device, and no more than a
        sliding layer's window has key blocks (`window_blocks`; a split gets whole blocks, so
        more would be empty). A function of the batch size and the layer kind only, so graphs
        and eager steps of one size agree."""
        wanted = -(-self.num_programs // (num_seqs * kv_heads))
        return max(1, min(MAX_SPLITS, triton.next_power_of_2(wanted), window_blocks))

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        positions: torch.Tensor,  # [tokens]
        rotary: RotaryEmbedding,
        cache: tuple[torch.Tensor, torch.Tensor] | None,  # [pages, page_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        layer: LayerAttention = FULL,
        sinks: torch.Tensor | None = None,  # [heads]
    ) -> torch.Tensor:  # [tokens, heads, head_dim]
        if cache is None:
            return self._dense.forward(q, k, v, positions, rotary, None, meta, layer, sinks)
        meta = meta.for_cache(cache)  # the layer's KV group's tables
        k_cache, v_cache = cache
        assert meta.slot_mapping is not None and meta.block_tables is not None
        assert meta.seq_lens is not None and meta.query_start_loc is not None
        assert k_cache.shape[1] == self.page_size
        if sinks is not None:
            assert sinks.shape == (q.shape[1],), "sinks: one per query head of this rank"
            sinks = sinks.contiguous()  # a no-op for a parameter, as it is
        # One kernel: rotary on q and k, K and V into the cache (engine/layers/rotary_kv.py).
        q = rotary_kv(
            q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping
        )
        out = torch.empty_like(q)
        kind = kind_constants(self.scale, layer, sinks)
        if meta.decode_only:
            window_blocks = MAX_SPLITS
            if layer.sliding_window is not None:
                window_blocks = -(-layer.sliding_window // block_n(q.shape[2]))
            splits = self.num_splits(q.shape[0], k_cache.shape[2], window_blocks)
            decode(q, k_cache, v_cache, out, meta, splits, kind, sinks)
        else:
            prefill(q, k_cache, v_cache, out, meta, kind, sinks)
        return out
