"""A linear layer on FP8 weights with block scales (DeepSeek-V3 / Qwen3-FP8's format), weight
only: `out = x @ (w * scale).T`, `w` e4m3 [N, K] and one float32 `scale_inv` per
[BLOCK_N_Q, BLOCK_K_Q] tile (128 x 128; the last tile of a dimension may be partial). The
reference it equals is engine/weights/dequantize.py's `fp8_block` followed by F.linear. The
in-format projections (fp8_projection.py) call it with BLOCK_N_Q = 1: one scale row per weight
row, which also serves per-channel scales (one scale column spanning every input column).

Each program computes a [BLOCK_M, BLOCK_N] tile of the output: per K step it loads the weight
tile in e4m3 (one byte a value: the point of keeping FP8 on a GPU, where decode reads every
weight once per step), widens it to float32, multiplies each value by its block's scale,
rounds it to x's dtype (the value the dequantized weight holds) and accumulates the dot in
float32. Activations stay in the model's dtype (no activation quantization: the checkpoint
declares dynamic activation scales, which a weight-only kernel need not compute, and the
numbers stay those of the dequantized weights). Triton's interpreter has no FP8 dot, which
this kernel never asks for: it runs under TRITON_INTERPRET=1, so it is tested on the CPU in
float32 (tests/engine/layers/test_fp8_linear_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64  # divides the 128 of the format's blocks: one scale column per K step


@triton.jit
def _fp8_block_linear(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] e4m3, contiguous
    s_ptr,  # [cdiv(N, BLOCK_N_Q), cdiv(K, BLOCK_K_Q)] float32, contiguous
    bias_ptr,  # [N] or a dummy
    out_ptr,  # [M, N] contiguous
    M,
    stride_x,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N_Q: tl.constexpr,
    BLOCK_K_Q: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    scale_cols: tl.constexpr = (K + BLOCK_K_Q - 1) // BLOCK_K_Q
    scale_rows = s_ptr + (n // BLOCK_N_Q) * scale_cols  # [BLOCK_N]: each column's scale row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + m.to(tl.int64)[:, None] * stride_x + k[None, :],
            mask=(m[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + n.to(tl.int64)[None, :] * K + k[:, None],
            mask=(n[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the weight's tile, transposed
        scale = tl.load(scale_rows + k0 // BLOCK_K_Q, mask=n < N, other=0.0)  # [BLOCK_N]
        tile = (w.to(tl.float32) * scale[None, :]).to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, tile, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


def fp8_block_linear(
    x: torch.Tensor,  # [M, K] in the model's dtype
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [cdiv(N, bn), cdiv(K, bk)] float32
    block: tuple[int, int],  # (bn, bk): the checkpoint's weight_block_size
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ dequantized(weight).T (+ bias), the weight read in FP8."""
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
    assert x.stride(1) == 1 and scale_inv.is_contiguous()
    block_n, block_k = block
    assert block_k % BLOCK_K == 0, f"block_k {block_k} is not a multiple of {BLOCK_K}"
    m, (n, k) = x.shape[0], weight.shape
    assert x.shape[1] == k and scale_inv.shape == (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _fp8_block_linear[grid](
        x,
        weight,
        scale_inv.float(),
        bias if bias is not None else out,
        out,
        m,
        x.stride(0),
        N=n,
        K=k,
        BLOCK_N_Q=block_n,
        BLOCK_K_Q=block_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out
