"""RMSNorm, fused with the residual add before it (vLLM's pattern).

`norm(x)` normalises x; `norm(x, residual)` adds x to the residual stream first and returns
(normalised sum, new residual stream). A decoder layer's two norms take the add of the
sublayer before them, and the model's final norm the last layer's add, so each norm and its
add are one kernel on the Triton path, and one C call on the CPU (engine/layers/cpu_ops.py).

Numerics are transformers': the add in the model dtype, the normalisation in float32, the
result cast back to the model dtype and then multiplied by the weight in the model dtype.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from engine.layers import cpu_ops


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: (normalised x + residual, x + residual); x alone without one."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype), x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.triton = triton  # the Triton kernel (engine/layers/rms_norm_kernel.py)

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
        if self.triton:
            from engine.layers.rms_norm_kernel import rms_norm

            out, stream = rms_norm(x, self.weight, self.eps, residual)
        elif cpu_ops.usable(x) and self.weight.dtype == x.dtype:
            out, stream = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        else:
            out, stream = rms_norm_ref(x, self.weight, self.eps, residual)
        return out if residual is None else (out, stream)
