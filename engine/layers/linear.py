"""`linear`: F.linear, except for float32 inference on the CPU, which runs oneDNN's GEMM.

On the CPU, F.linear in float32 calls MKL's sgemm; oneDNN's linear (`mkldnn._linear_pointwise`,
the op Inductor's CPU freezing emits) is 1.1-2.1x faster at the Llama projection shapes
(largest on the LM head, [32000, 768] at 16 rows). In bfloat16, F.linear already runs oneDNN,
so it stays. oneDNN sums in another order than MKL: results differ in the last bits, and the
float32 HF equivalence test (greedy tokens) checks they still choose the same tokens. The op has
no backward, so with autograd recording (training) F.linear runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN = torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
