"""The experts' GEMMs for (token, choice) pairs grouped by expert, one Triton launch per
projection; engine/moe/experts.py's loop over the experts (StackedExperts, torch path) is the
reference it equals.

`out[r] = a[rows[r]] @ weight[e].T` for every grouped pair r, e being the expert whose group
holds r (`expert_start[e] <= r < expert_start[e + 1]`). Each expert's group is cut into blocks
of BLOCK_M pairs; a program computes one block's BLOCK_N columns. The grid is sized from the
pair count alone (every expert may waste one partial block: pairs / BLOCK_M + experts blocks),
so nothing waits for the per-expert counts on the host: a program finds its expert and block
from `block_start` (each expert's first block, computed on the device) and returns when it has
none. No host sync and fixed shapes for a fixed token count: CUDA-graph capturable.

Accumulates in float32 and stores in the output's dtype, as a GEMM in the model's dtype does;
float32 inputs multiply in IEEE float32, not TF32 (torch's matmul default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_gemm(
    a_ptr,  # [rows of a, K]; row r of the group reads a[rows[r]]
    rows_ptr,  # [pairs] int64
    w_ptr,  # [experts, N, K] contiguous
    out_ptr,  # [pairs, N] contiguous
    expert_start_ptr,  # [experts + 1] int64: each expert's first grouped pair
    block_start_ptr,  # [experts] int64: each expert's first block
    stride_a,
    N: tl.constexpr,
    K: tl.constexpr,
    EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    starts = tl.load(block_start_ptr + experts, mask=experts < EXPERTS, other=2**62)
    expert = tl.sum((starts <= block).to(tl.int32)) - 1  # the last expert starting at or before
    first = tl.load(expert_start_ptr + expert)
    end = tl.load(expert_start_ptr + expert + 1)
    local = block - tl.load(block_start_ptr + expert)
    r = first + local * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = r < end  # none: a block past the last expert's (the grid's spare blocks)
    src = tl.load(rows_ptr + r, mask=valid, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert.to(tl.int64) * N * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + src[:, None] * stride_a + k[None, :],
            mask=valid[:, None] & (k[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_base + n[None, :] * K + k[:, None],
            mask=(n[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: weight[e].T
        acc += tl.dot(a, w, input_precision=PRECISION)
    out = out_ptr + r.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < N))


def group_blocks(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert_start [experts + 1], block_start [experts]) from the per-expert pair counts, on
    the device: where each expert's pairs and blocks begin."""
    expert_start = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=expert_start[1:])
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_start = torch.cumsum(blocks, 0) - blocks
    return expert_start, block_start


def grouped_gemm(
    a: torch.Tensor,  # [rows, K], unit column stride
    rows: torch.Tensor,  # [pairs] int64: the row of `a` each grouped pair reads
    weight: torch.Tensor,  # [experts, N, K] contiguous
    expert_start: torch.Tensor,  # [experts + 1] int64
    block_start: torch.Tensor,  # [experts] int64
) -> torch.Tensor:  # [pairs, N] in a's dtype
    """One launch: every grouped pair's row of `a` times its expert's weight, transposed."""
    assert a.stride(1) == 1 and weight.is_contiguous()
    experts, n, k = weight.shape
    pairs = rows.shape[0]
    out = torch.empty((pairs, n), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(pairs, BLOCK_M) + experts, triton.cdiv(n, BLOCK_N))
    _grouped_gemm[grid](
        a,
        rows,
        weight,
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
        BLOCK_K=BLOCK_K,
        # float32 as torch computes it (no TF32: torch's matmul default); else the default.
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out
