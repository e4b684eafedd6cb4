"""SiLU-and-multiply as one Triton kernel; engine/layers/silu_and_mul.py holds the torch
reference it equals.

A program per (token, block of BLOCK columns). The gate and up inputs are read through their
row strides: the two column halves of one gate/up projection's output, in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul(
    gate_ptr,
    up_ptr,
    out_ptr,  # [tokens, inter] contiguous
    stride_gate,
    stride_up,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(gate_ptr + token * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + token * stride_up + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu rounds to the model dtype first
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * INTER + cols, out, mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: gate and up [tokens, inter], each with unit column stride."""
    assert gate.shape == up.shape and gate.dim() == 2
    assert gate.stride(1) == 1 and up.stride(1) == 1
    tokens, inter = gate.shape
    out = torch.empty((tokens, inter), dtype=gate.dtype, device=gate.device)
    _silu_and_mul[(tokens, triton.cdiv(inter, BLOCK))](
        gate, up, out, gate.stride(0), up.stride(0), INTER=inter, BLOCK=BLOCK
    )
    return out
