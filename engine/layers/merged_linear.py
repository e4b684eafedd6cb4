"""MergedLinear: several checkpoint projections of one input, stacked into one weight.

Attention's q, k and v projections read the same input, and so do the MLP's gate and up: each
group becomes one [sum of outputs, in] weight, and one GEMM per group instead of one per
projection (a decode step is bound by launches and weight reads, not by FLOPs). Checkpoints keep
the projections apart, so `checkpoint_tensors` names each part by its checkpoint name, as a
view of its rows: loading, weight updates and live_weights copy into these views, and the
merged parameter changes with them.

A fused one (`fused` set: Phi-3's qkv_proj and gate_up_proj) is stored whole by its
checkpoints, under the module's own name: its owner names `weight` itself, and an adapter
targets it whole, as peft does.

In FP8 (engine/layers/fp8_projection.py) the merged weight is e4m3 and its per-row scales
stack as its rows do.

Column-parallel: each part is built at this rank's local size (engine/models/sharding.py says
which rows of the checkpoint tensor that is), so a rank's weight is its q, k and v (or gate and
up) slices stacked, in that order.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.fp8_projection import project


class MergedLinear(nn.Module):
    """`parts` maps each projection's name (`q_proj`, ...) to its output size, in the order its
    rows are stacked; the forward's output columns follow the same order."""

    weight_scale: torch.Tensor | None  # [rows, cdiv(cols, fp8_block_k)] when in FP8

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.parts = dict(parts)
        self.fused = False  # set by a family whose checkpoints keep it whole (see above)
        self.sizes = list(self.parts.values())  # the forward's split, without a per-call rebuild
        out = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        # Set by fp8_projection.keep_fp8 when the weight is held in FP8.
        self.register_buffer("weight_scale", None, persistent=False)
        self.fp8_block_k = 0
        # NOTE: part by part (q weight, q bias, k weight, ...), as separate nn.Linear modules
        # would initialise and draw from the RNG: the demo model's initialisation is unchanged.
        bound = 1 / math.sqrt(in_features)
        for name, rows in self.checkpoint_tensors().items():
            if name.endswith(".weight"):
                nn.init.kaiming_uniform_(rows, a=math.sqrt(5))
            else:
                nn.init.uniform_(rows, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, sum(sizes)]
        return project(x, self.weight, self.bias, self.weight_scale, self.fp8_block_k)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """`{part}.weight` (and `{part}.bias`), part by part -> that part's rows: views sharing
        the merged parameters' storage, outside autograd."""
        weights = self._rows(self.weight)
        biases = self._rows(self.bias) if self.bias is not None else {}
        tensors: dict[str, torch.Tensor] = {}
        for name in self.parts:
            tensors[f"{name}.weight"] = weights[name]
            if name in biases:
                tensors[f"{name}.bias"] = biases[name]
        return tensors

    def _rows(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = param.detach().split(self.sizes, dim=0)
        return dict(zip(self.parts, rows, strict=True))
