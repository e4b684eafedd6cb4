"""A step's segmented LoRA matmul on Triton: the rows of every adapter slot at once, one
launch for the shrink and one per part for the expand; ProjectionLora.add's loop over the
adapters (engine/lora/lora_weights.py, the torch path) is the reference it equals.

The step's token rows are grouped by slot (`Segments`: every slot's rows back to back, each
slot's first grouped row and first block of BLOCK_M rows; empty slots have none). The shrink,
`u[g] = x[rows[g]] @ A[slot].T` for all parts at max_rank ([grouped, parts * max_rank]), is
the experts' grouped GEMM (engine/layers/grouped_gemm_kernel.py) with slots for experts. The
expand adds `u[g, part's ranks] @ B_part[slot].T * scaling[slot, part]` into y's part columns
at row rows[g], in place: each row belongs to one slot and each column to one part, so no two
programs touch the same element (no atomics). Ranks below max_rank multiply the zero padding.
The grids are sized from the token count and the slot count alone: no host sync.

As the torch path, u and the delta are rounded to the model's dtype before the add; float32
multiplies in IEEE float32, not TF32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine.layers.grouped_gemm_kernel import BLOCK_M, grouped_gemm

BLOCK_N = 64
BLOCK_R = 16


@dataclass(frozen=True)
class Segments:
    """A step's token rows grouped by slot, on the device."""

    rows: torch.Tensor  # [grouped] int64: the token row of each grouped row
    slot_start: torch.Tensor  # [slots + 1] int64: each slot's first grouped row
    block_start: torch.Tensor  # [slots] int64: each slot's first block of BLOCK_M rows
    slots: int


def segments(groups: list[tuple[int, torch.Tensor]], slots: int) -> Segments:
    """The Segments of `groups` (each slot present with its token rows, on the device). The
    counts are the row tensors' shapes, known on the host: nothing waits for the device."""
    counts = np.zeros(slots, dtype=np.int64)
    for slot, rows in groups:
        counts[slot] = rows.shape[0]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    starts = np.concatenate([[0], np.cumsum(counts), np.cumsum(blocks) - blocks])
    device = groups[0][1].device
    packed = torch.from_numpy(starts).to(device, non_blocking=True)
    rows = torch.cat([rows for _, rows in groups])
    return Segments(rows, packed[: slots + 1], packed[slots + 1 :], slots)


@triton.jit
def _expand(
    u_ptr,  # [grouped, stride_u]: this part's ranks from column u_column
    rows_ptr,  # [grouped] int64
    b_ptr,  # [slots, N, R] contiguous: this part's B
    y_ptr,  # [tokens, stride_y]: this part's columns from column y_column
    scaling_ptr,  # [slots]: this part's scaling per slot (float32), strided
    slot_start_ptr,  # [slots + 1] int64
    block_start_ptr,  # [slots] int64
    stride_u,
    stride_y,
    stride_scaling,
    u_column,
    y_column,
    N: tl.constexpr,
    R: tl.constexpr,
    SLOTS: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    slots = tl.arange(0, SLOTS_POW2)
    starts = tl.load(block_start_ptr + slots, mask=slots < SLOTS, other=2**62)
    slot = tl.sum((starts <= block).to(tl.int32)) - 1  # the last slot starting at or before
    first = tl.load(slot_start_ptr + slot)
    end = tl.load(slot_start_ptr + slot + 1)
    g = first + (block - tl.load(block_start_ptr + slot)) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = g < end  # none: a block past the last slot's (the grid's spare blocks)
    dst = tl.load(rows_ptr + g, mask=valid, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_base = b_ptr + slot.to(tl.int64) * N * R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        u = tl.load(
            u_ptr + g.to(tl.int64)[:, None] * stride_u + u_column + r[None, :],
            mask=valid[:, None] & (r[None, :] < R),
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        b = tl.load(
            b_base + n[None, :] * R + r[:, None],
            mask=(n[None, :] < N) & (r[:, None] < R),
            other=0.0,
        )  # [BLOCK_R, BLOCK_N]: B[slot].T
        acc += tl.dot(u, b, input_precision=PRECISION)
    dtype = y_ptr.dtype.element_ty
    scaling = tl.load(scaling_ptr + slot * stride_scaling)
    delta = (acc.to(dtype).to(tl.float32) * scaling).to(dtype)  # as torch: B(u), then * s
    y = y_ptr + dst[:, None] * stride_y + y_column + n[None, :]
    mask = valid[:, None] & (n[None, :] < N)
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + delta.to(tl.float32)).to(dtype), mask=mask)


def add_lora(
    x: torch.Tensor,  # [tokens, in], unit column stride
    y: torch.Tensor,  # [tokens, out], unit column stride: added to in place
    a: torch.Tensor,  # [slots, parts * max_rank, in] contiguous
    b: list[torch.Tensor],  # per part [slots, out_part, max_rank] contiguous
    scaling: torch.Tensor,  # [slots, parts] float32: 0 where a slot's adapter skips a part
    columns: list[tuple[int, int]],  # each part's (first column, width) in y
    seg: Segments,
) -> None:
    """Add every grouped row's LoRA delta into y: the shrink, then each part's expand."""
    assert x.stride(1) == 1 and y.stride(1) == 1
    u = grouped_gemm(x, seg.rows, a, seg.slot_start, seg.block_start)  # [grouped, parts * r]
    max_rank = a.shape[1] // len(b)
    grouped = seg.rows.shape[0]
    for part, (column, width) in enumerate(columns):
        assert b[part].is_contiguous()
        grid = (triton.cdiv(grouped, BLOCK_M) + seg.slots, triton.cdiv(width, BLOCK_N))
        _expand[grid](
            u,
            seg.rows,
            b[part],
            y,
            scaling[:, part],
            seg.slot_start,
            seg.block_start,
            u.stride(0),
            y.stride(0),
            scaling.stride(0),
            part * max_rank,
            column,
            N=width,
            R=max_rank,
            SLOTS=seg.slots,
            SLOTS_POW2=triton.next_power_of_2(seg.slots),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_R=BLOCK_R,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )
