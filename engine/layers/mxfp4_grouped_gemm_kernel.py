"""The experts' grouped GEMMs on MXFP4 weights (gpt-oss's experts, kept packed): what
grouped_gemm_kernel.py computes on the dequantized weights, reading 4.25 bits a weight.

`weight[e]` [N, K] is held as `blocks[e]` [N, K / 2] uint8 (two e2m1 values a byte, low nibble
first) and `scales[e]` [N, K / 32] uint8 (E8M0: 2^(s - 127) for 32 values), the checkpoint's
`*_blocks` and `*_scales` as they are (engine/weights/dequantize.py's `mxfp4` is the reference).
Per K step of 32 (one scale per output column) a program decodes its [32, BLOCK_N] tile: each
nibble's e2m1 value (exact in float32), times its scale built from the exponent's bits (exact,
2^-127 included, with no exp2 approximation), rounded to a's dtype (the value the dequantized
weight holds: transformers' `convert_moe_packed_tensors` rounds its ldexp there), then one dot
accumulated in float32. Grid, grouping and CUDA-graph safety as grouped_gemm_kernel.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.grouped_gemm_kernel import BLOCK_M, BLOCK_N

MXFP4_BLOCK = 32  # values per scale: the kernel's K step


@triton.jit
def _e2m1_tile(byte, k):
    """[K, N] bytes and each row's k -> the e2m1 values (k's nibble), float32."""
    nibble = (byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
    exponent = (nibble >> 1) & 3
    half = (nibble & 1).to(tl.float32) * 0.5
    power = (1 << exponent).to(tl.float32) * 0.5  # 2^(exponent - 1) for exponent >= 1
    value = tl.where(exponent == 0, half, (1.0 + half) * power)
    return tl.where(nibble >= 8, -value, value)


@triton.jit
def _mxfp4_grouped_gemm(
    a_ptr,  # [rows of a, K]; row r of the group reads a[rows[r]]
    rows_ptr,  # [pairs] int64
    blocks_ptr,  # [experts, N, K / 2] uint8 contiguous
    scales_ptr,  # [experts, N, K / 32] uint8 contiguous
    out_ptr,  # [pairs, N] contiguous
    expert_start_ptr,  # [experts + 1] int64
    block_start_ptr,  # [experts] int64
    stride_a,
    N: tl.constexpr,
    K: tl.constexpr,
    EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    starts = tl.load(block_start_ptr + experts, mask=experts < EXPERTS, other=2**62)
    expert = tl.sum((starts <= block).to(tl.int32)) - 1
    first = tl.load(expert_start_ptr + expert)
    end = tl.load(expert_start_ptr + expert + 1)
    r = first + (block - tl.load(block_start_ptr + expert)) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = r < end
    src = tl.load(rows_ptr + r, mask=valid, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_base = blocks_ptr + expert.to(tl.int64) * N * (K // 2)
    s_base = scales_ptr + expert.to(tl.int64) * N * (K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        k = k0 + tl.arange(0, 32)
        a = tl.load(a_ptr + src[:, None] * stride_a + k[None, :], mask=valid[:, None], other=0.0)
        byte = tl.load(b_base + n[None, :] * (K // 2) + (k // 2)[:, None], mask=n[None, :] < N)
        s = tl.load(s_base + n * (K // 32) + k0 // 32, mask=n < N, other=127).to(tl.int32)
        bits = tl.where(s == 0, 1 << 22, s << 23)  # 2^(s - 127) as float32 bits (0: subnormal)
        scale = bits.to(tl.float32, bitcast=True)
        tile = (_e2m1_tile(byte, k) * scale[None, :]).to(a_ptr.dtype.element_ty)
        acc += tl.dot(a, tile, input_precision=PRECISION)
    out = out_ptr + r.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < N))


def mxfp4_grouped_gemm(
    a: torch.Tensor,  # [rows, K], unit column stride
    rows: torch.Tensor,  # [pairs] int64: the row of `a` each grouped pair reads
    blocks: torch.Tensor,  # [experts, N, K / 2] uint8 contiguous
    scales: torch.Tensor,  # [experts, N, K / 32] uint8 contiguous
    expert_start: torch.Tensor,  # [experts + 1] int64 (grouped_gemm_kernel.group_blocks)
    block_start: torch.Tensor,  # [experts] int64
) -> torch.Tensor:  # [pairs, N] in a's dtype
    """One launch: every grouped pair's row of `a` times its expert's MXFP4 weight, transposed."""
    assert a.stride(1) == 1 and blocks.is_contiguous() and scales.is_contiguous()
    experts, n, half_k = blocks.shape
    k = 2 * half_k
    assert k % MXFP4_BLOCK == 0 and scales.shape == (experts, n, k // MXFP4_BLOCK)
    assert a.shape[1] == k
    pairs = rows.shape[0]
    out = torch.empty((pairs, n), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(pairs, BLOCK_M) + experts, triton.cdiv(n, BLOCK_N))
    _mxfp4_grouped_gemm[grid](
        a,
        rows,
        blocks,
        scales,
        out,
        expert_start,
        block_start,
        a.stride(0),
        N=n,
        K=k,
        EXPERTS=experts,
        EXPERTS_POW2=triton.next_power_of_2(experts),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out
