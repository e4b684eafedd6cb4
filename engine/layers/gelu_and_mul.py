"""The Gemma families' MLP activation: GeLU (tanh approximation) of the gate times the up
projection, as transformers' `gelu_pytorch_tanh` computes it.

The gate and up halves are usually the two column halves of one gate/up projection's output
([tokens, 2 * inter], gate first), read as strided views. As transformers: the activation in
the model dtype, then the product in the model dtype. Torch only (two elementwise kernels);
the Triton and C paths of silu_and_mul.py have no GeLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# transformers' `hidden_activation` names this layer computes.
GELU_TANH = "gelu_pytorch_tanh"


def gelu_tanh_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, [tokens, inter]."""
    return F.gelu(gate, approximate="tanh") * up


class GeluTanhAndMul(nn.Module):
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul_ref(gate, up)
