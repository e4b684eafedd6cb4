"""The CPU backend: torch_ref, except that decode rows run cpu_attention.c, reading the KV pages in
place (with the layer's window, scale, soft cap and sinks), and that the rotary embedding and the
KV write are one C call too.

torch_ref gathers every decode row's pages into a new tensor, once per layer, and runs SDPA on
the copy, padded to the longest context of its group; with one query row SDPA's CPU kernel is
far from the memory bandwidth that decode attention is bound by. The kernel reads each row's
keys and values once, where they lie, with no padding, so all decode rows are one call, in
batch order. Prefill rows (several queries each) stay on torch_ref's SDPA, which is GEMM-bound
and fast there. float32 and bfloat16 only (`make_backend` picks torch_ref for other dtypes).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import LayerAttention
from engine.attention.cpu_kernels import decode_attention, rotary_store
from engine.attention.metadata import DecodeGroup
from engine.attention.torch_ref import TorchRefAttention

if TYPE_CHECKING:
    from engine.layers.rope import RotaryEmbedding


class CpuPagedAttention(TorchRefAttention):
    name = "cpu"

    def __init__(self, scale: float, page_size: int, lib: ctypes.CDLL) -> None:
        super().__init__(scale, page_size)
        self.lib = lib  # engine/attention/cpu_kernels.py's load()

    def _split(self, decodes: list[int], context_lens: list[int]) -> list[list[int]]:
        return [decodes] if decodes else []  # no padding to share: one call, batch order

    def _group(
        self, rows: torch.Tensor | None, tables: torch.Tensor, lens: torch.Tensor, pages: int
    ) -> DecodeGroup:
        return DecodeGroup(rows, tables, lens.to(torch.int32), mask=None)

    def _rotate_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = cache
        if not k_cache.is_contiguous():  # a page-strided view: the C code reads dense pages
            return super()._rotate_and_store(q, k, v, positions, rotary, cache, slots)
        return rotary_store(
            self.lib, q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots
        )

    def _decode_layer(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: DecodeGroup,
        layer: LayerAttention,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every layer kind in the kernel: a window reads only the pages it sees."""
        scale = self.scale if layer.scale is None else layer.scale
        return decode_attention(
            self.lib,
            q,
            k_cache,
            v_cache,
            group.tables,
            group.lens,
            scale,
            layer.sliding_window,
            layer.softcap,
            sinks,
        )
