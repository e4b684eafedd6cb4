"""RMSNorm (with the residual add before it) as one Triton kernel; engine/layers/rms_norm.py
holds the torch reference it equals.

One program per row: the row (plus its residual) is loaded once, the new residual stream
stored, the sum of squares taken in float32, and the weighted result stored. Rows are the
vectors along the last dim of a [rows, dim] or [tokens, heads, dim] input (q/k norm), read
through their strides, so the column views of a fused projection's output need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,  # [rows, dim] contiguous
    res_out_ptr,  # [rows, dim] contiguous: x + residual
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    INNER: tl.constexpr,  # rows per index of the first dim (heads; 1 for [rows, dim])
    DIM: tl.constexpr,
    EPS: tl.constexpr,  # per model; torch.compile would pass a float argument as fp64
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    row = (i * INNER + j).to(tl.int64) * DIM
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i * stride_r0 + j * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the add in the model dtype
        tl.store(res_out_ptr + row + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, 0) / DIM
    normed = (x32 * (1.0 / tl.sqrt(mean_square + EPS))).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)  # the weight in the model dtype
    tl.store(out_ptr + row + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's contract: (normalised x + residual, x + residual), new tensors (x alone
    and x itself without a residual)."""
    dim = x.shape[-1]
    assert x.stride(-1) == 1 and x.dim() in (2, 3), (
        "rows of the last dim, [rows|tokens, (heads,) dim]"
    )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    stream = x
    outer, inner = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    x_strides = (x.stride(0), x.stride(1) if x.dim() == 3 else 0)
    r_strides = x_strides
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        stream = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        r_strides = (residual.stride(0), residual.stride(1) if x.dim() == 3 else 0)
    _rms_norm[(outer, inner)](
        x,
        x if residual is None else residual,
        weight,
        out,
        stream,
        *x_strides,
        *r_strides,
        INNER=inner,
        DIM=dim,
        EPS=eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(dim),
    )
    return out, stream
