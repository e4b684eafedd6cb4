"""GemmaRMSNorm: the Gemma families' RMSNorm, all in float32, fused with the residual add before
it as engine/layers/rms_norm.py's RMSNorm is.

Gemma 2 and 3 scale by (1 + weight) (their checkpoints store the weight centred on 0), Gemma 4
by the weight itself: `offset` is the 1 (or 0). Unlike Llama's norm, which rounds the
normalised value to the model dtype before the weight multiplies it, transformers' Gemma norm
multiplies in float32 and rounds once at the end (transformers PR 29402); in bfloat16 the two
differ, so this is a norm of its own rather than a flag on RMSNorm. The residual add is in the
model dtype, as transformers' `residual + hidden_states`.

The Triton and C norms compute Llama's rounding: weight * (normalised, rounded to the model
dtype). In float32 there is nothing to round, so there the C norm (engine/layers/cpu_ops.py: one
call instead of about eight torch ops) computes this one given (offset + weight); in other
dtypes, and on the GPU, this runs its torch code.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from engine.layers import cpu_ops


def gemma_rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised x + residual, x + residual); x alone without one."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(x.dtype), x


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # as transformers: (offset + 0) = identity
        self.eps = eps
        self.offset = offset

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x [..., dim]; residual, when given, of x's shape
        if x.dtype == self.weight.dtype == torch.float32 and cpu_ops.usable(x):
            scale = self.weight + self.offset  # [dim]: one small op, then one C call
            out, stream = cpu_ops.rms_norm(x, scale, self.eps, residual)
        else:
            out, stream = gemma_rms_norm_ref(x, self.weight, self.eps, self.offset, residual)
        return out if residual is None else (out, stream)
