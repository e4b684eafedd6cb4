"""The MLP's activation: SiLU of the gate times the up projection, one kernel on Triton (one C
call on the CPU: engine/layers/cpu_ops.py).

The gate and up halves are usually the two column halves of one gate/up projection's output
([tokens, 2 * inter], gate first): strided views, read in place. As transformers: SiLU in the
model dtype, then the product in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_ops


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The torch reference: silu(gate) * up, [tokens, inter]."""
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self, triton: bool = False) -> None:
        super().__init__()
        self.triton = triton  # the Triton kernel (engine/layers/silu_and_mul_kernel.py)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.triton:
            from engine.layers.silu_and_mul_kernel import silu_and_mul

            return silu_and_mul(gate, up)
        if cpu_ops.usable(gate):
            return cpu_ops.silu_and_mul(gate, up)
        return silu_and_mul_ref(gate, up)
