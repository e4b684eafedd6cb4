"""`linear`: F.linear, except for inference on the CPU, which runs oneDNN's GEMM on packed weights.

On the CPU, F.linear in float32 calls MKL's sgemm; oneDNN's linear (`mkldnn._linear_pointwise`,
the op Inductor's CPU freezing emits) is 1.1-2.1x faster at the Llama projection shapes
(largest on the LM head, [32000, 768] at 16 rows). It runs faster still on a weight reordered
once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`): 10-25% on the decode
shapes in float32; in bfloat16, where F.linear already runs oneDNN on the plain layout, the
offline llama-75m run gained 22-25%. The packed copy is a cache kept on the weight tensor, so
weights cost twice their memory on the CPU; it is rebuilt when the weight's version counter
moves (any in-place write, also through a view: weight updates write that way). oneDNN sums
in another order than MKL: results differ in the last bits, and the float32 HF equivalence
test (greedy tokens) checks they still choose the same tokens. The op has no backward, so
with autograd recording (training) F.linear runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN = torch.backends.mkldnn.is_available()


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (chosen for 64 rows; any row count runs on it)."""
    entry = getattr(weight, "_onednn_packed", None)
    if entry is None or entry[0] != weight._version:
        entry = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight, 64))
        weight._onednn_packed = entry  # type: ignore[attr-defined]
    return entry[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not torch.is_grad_enabled()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)
