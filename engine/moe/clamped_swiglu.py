"""ClampedSwiGLU: gpt-oss's expert activation, as transformers' `GptOssExperts._apply_gate`.

gpt-oss's checkpoints interleave each expert's gate and up columns (`gate_up_proj[..., ::2]`
is the gate, `[..., 1::2]` the up), and StackedExperts keeps its rows in that order
(engine/moe/experts.py), so this reads the two as strided views of the gate/up output. The gate
is clamped above at `limit`, the up at +-`limit`; out = (up + 1) * gate * sigmoid(alpha *
gate), every op in the input's dtype, in transformers' order.
"""

from __future__ import annotations

import torch
from torch import nn


class ClampedSwiGLU(nn.Module):
    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        # [rows, 2 * inter], gate and up columns interleaved -> [rows, inter]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu
