"""In-format FP8 projections: a MergedLinear or RowParallelLinear that holds its weight as e4m3
with one float32 scale per weight row and block of `block_k` input columns, and computes
through fp8_linear_kernel.py instead of holding the dequantized weight.

`keep_fp8` turns a projection in format (before its storage is allocated: on the meta device,
after the model's dtype cast, which would otherwise widen the e4m3 weight); its `weight` stays
a Parameter of the same shape (its checkpoint views, LoRA and tensor parallelism see the same
rows and columns), e4m3 now, and `weight_scale` is a buffer beside it ([rows, cdiv(cols,
block_k)]: engine/weights/fp8_format.py says why per row). The scale is a buffer, not a
parameter: it is no checkpoint tensor of the model's (the loader and weight updates write it
with its weight: engine/weights/fp8_layers.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from engine.layers.linear import linear


class Fp8Capable(Protocol):
    """A projection that can hold its weight in FP8 (MergedLinear, RowParallelLinear)."""

    weight: nn.Parameter
    weight_scale: torch.Tensor | None
    fp8_block_k: int


def keep_fp8(module: Fp8Capable, block_k: int) -> None:
    """Hold `module.weight` ([rows, cols]) as e4m3 with per-row scales of `block_k` columns."""
    rows, cols = module.weight.shape
    device = module.weight.device
    module.weight = nn.Parameter(
        torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device), requires_grad=False
    )
    module.weight_scale = torch.empty(rows, -(-cols // block_k), device=device)
    module.fp8_block_k = block_k


def project(
    x: torch.Tensor,  # [tokens, cols]
    weight: torch.Tensor,  # [rows, cols]
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,  # [rows, cdiv(cols, block_k)] float32; None: a plain weight
    block_k: int,
) -> torch.Tensor:  # [tokens, rows] in x's dtype
    """x @ weight.T (+ bias): `linear`, or the FP8 kernel on an in-format weight."""
    if scale is None:
        return linear(x, weight, bias)
    from engine.layers.fp8_linear_kernel import fp8_block_linear  # imports triton

    return fp8_block_linear(x.contiguous(), weight, scale, (1, block_k), bias)
