"""One projection's resident adapters, stacked by slot, and a step's LoRA pass over them.

A projection (merged q/k/v or gate/up, or o_proj, down_proj) holds, for every slot,
A as [slots, parts * max_rank, in] (part p's rows at p * max_rank) and each part's B as
[slots, out_part, max_rank]; an adapter of a lower rank fills the first rows (A) and columns
(B), the rest stay zero. A step adds to the projection's output, for each adapter present, the
delta of its tokens (grouped by adapter: a segmented LoRA matmul in torch):
`y[rows, part columns] += lora_B(lora_A(x[rows])) * scaling`, part by part, which is peft's
arithmetic (engine/lora/adapter_file.py) at the adapter's own rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine.lora.lora_kernel import Segments


class ProjectionLora:
    """`parts` maps each part's name to its output size, in the projection's column order."""

    def __init__(
        self,
        parts: Mapping[str, int],
        in_features: int,
        slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_rank = max_rank
        self.columns: list[tuple[int, int]] = []  # each part's (first column, width) in y
        first = 0
        for size in parts.values():
            self.columns.append((first, size))
            first += size
        self.a = torch.zeros(slots, len(parts) * max_rank, in_features, device=device, dtype=dtype)
        self.b = [
            torch.zeros(slots, size, max_rank, device=device, dtype=dtype)
            for size in parts.values()
        ]
        # Per slot, the parts its adapter targets: (part, rank, scaling).
        self.active: list[list[tuple[int, int, float]]] = [[] for _ in range(slots)]
        # The same scalings on the device for the Triton path (0: a part the slot skips).
        self.scaling = torch.zeros(slots, len(parts), device=device, dtype=torch.float32)

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Install one part's A [r, in] and B [out_part, r] in `slot`."""
        rank, first = a.shape[0], part * self.max_rank
        self.a[slot, first : first + rank].copy_(a)
        self.b[part][slot, :, :rank].copy_(b)
        self.active[slot].append((part, rank, scaling))
        self.scaling[slot, part] = scaling

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        self.active[slot] = []
        self.scaling[slot].zero_()

    def add(self, x: torch.Tensor, y: torch.Tensor, slot: int, rows: torch.Tensor) -> None:
        """y[rows] += this slot's delta of x[rows], in place (x [tokens, in], y [tokens, out])."""
        parts = self.active[slot]
        if not parts:
            return  # the adapter does not target this projection
        xs = x.index_select(0, rows)  # [rows, in]
        for part, rank, scaling in parts:
            first = part * self.max_rank
            u = F.linear(xs, self.a[slot, first : first + rank])  # [rows, rank]
            delta = F.linear(u, self.b[part][slot, :, :rank]) * scaling  # [rows, out_part]
            column, width = self.columns[part]
            y[:, column : column + width].index_add_(0, rows, delta)


@dataclass(frozen=True)
class LoraStep:
    """A step's LoRA pass: each adapter slot present with its token rows (device int64), and
    every projection's stacked weights. Only built when some request of the step has an
    adapter: the base model's steps never see one. `triton`: the segmented Triton kernel
    (engine/lora/lora_kernel.py, two or more launches a projection) instead of the loop."""

    groups: list[tuple[int, torch.Tensor]]
    weights: Mapping[nn.Module, ProjectionLora]
    triton: bool = False

    @cached_property
    def segments(self) -> Segments:
        """The rows grouped by slot, for the kernel: built once a step, at its first use."""
        from engine.lora.lora_kernel import segments

        slots = next(iter(self.weights.values())).a.shape[0]
        return segments(self.groups, slots)

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to `module`'s output `y` (for input `x`) the deltas of every adapter present."""
        lora = self.weights.get(module)
        if lora is None:
            return
        if self.triton:
            from engine.lora.lora_kernel import add_lora

            add_lora(x, y, lora.a, lora.b, lora.scaling, lora.columns, self.segments)
            return
        for slot, rows in self.groups:
            lora.add(x, y, slot, rows)
