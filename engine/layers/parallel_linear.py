"""RowParallelLinear, and LoraPass: what a projection asks of a step's LoRA adapters.

A row-parallel projection's input dim is split over the tensor-parallel ranks (the model's
sharding table says which columns a rank holds): each rank computes a partial product, and one
all-reduce sums them. Column-parallel projections are MergedLinear (merged_linear.py): they
need no collective of their own.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn

from engine.layers.fp8_projection import project
from engine.parallel.tensor_parallel import TensorParallel


class LoraPass(Protocol):
    """A step's LoRA adapters (engine/lora/): `add` adds to a projection's output `y`, in
    place, the deltas of the tokens whose adapter targets that projection (`x` its input).
    A step without adapters passes None and runs none of it."""

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None: ...


class RowParallelLinear(nn.Module):
    """A linear layer whose input dim is split over the ranks: partial products, summed by one
    all-reduce; the (whole) bias is added once, after it."""

    weight_scale: torch.Tensor | None  # [rows, cdiv(cols, fp8_block_k)] when in FP8

    def __init__(self, in_local: int, out: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, in_local))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.tp = tp
        # Set by fp8_projection.keep_fp8 when the weight is held in FP8.
        self.register_buffer("weight_scale", None, persistent=False)
        self.fp8_block_k = 0
        # As nn.Linear initialises (and draws from the RNG): the demo model trains identically.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_local)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, lora: LoraPass | None = None) -> torch.Tensor:
        """`lora`: the step's adapters, whose deltas are added to this rank's partial output
        before the all-reduce (each rank's A holds its slice of the input columns, so the
        all-reduce sums their partial deltas into the whole one: no collective of its own)."""
        if not self.tp.enabled:
            y = project(x, self.weight, self.bias, self.weight_scale, self.fp8_block_k)
            if lora is not None:
                lora.add(self, x, y)
            return y
        y = project(x, self.weight, None, self.weight_scale, self.fp8_block_k)
        if lora is not None:
            lora.add(self, x, y)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
