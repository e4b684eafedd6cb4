"""The Gemma MLP's activation: tanh-approximated GeLU of the gate times the up projection.

Gemma 2, 3 and 4 (`hidden_activation: gelu_pytorch_tanh`) gate their MLPs with it, as Llama
gates with SiLU (silu_and_mul.py). As transformers: `F.gelu(gate, approximate="tanh")` in the
model dtype, then the product in the model dtype. Torch only: no kernel of its own yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GeluTanhAndMul(nn.Module):
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up, [tokens, inter]; gate and up may be strided column views."""
        return F.gelu(gate, approximate="tanh") * up
