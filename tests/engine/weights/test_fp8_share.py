"""A tensor-parallel rank's share of an in-format FP8 tensor (Fp8Slot.share): its rows with
their scales (column-parallel, any split), or its columns with their scale columns
(row-parallel, on a block boundary), dequantize to exactly its slice of the whole tensor's
dequantization, for block-128 and per-channel scales."""

from __future__ import annotations

import pytest
import torch

from engine.layers.fp8_projection import keep_fp8
from engine.layers.merged_linear import MergedLinear
from engine.parallel.shard_layout import Split
from engine.weights.dequantize import fp8_block, fp8_channel
from engine.weights.fp8_format import Fp8Format
from engine.weights.fp8_layers import Fp8Slot

ROWS, COLS = 320, 384
SPLITS = {
    "column, off a block": Split(0, 96, 224, ROWS),
    "row, on a block": Split(1, 128, 256, COLS),
    "row, the last block": Split(1, 256, 384, COLS),
}


def per_row(data: torch.Tensor, scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """What the kernel computes with: each value times its row's scale for its column."""
    expanded = scales.repeat_interleave(block_k, dim=1)[:, : data.shape[1]]
    return data.float() * expanded


@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("case", sorted(SPLITS))
def test_a_ranks_share_dequantizes_to_its_slice(block: tuple[int, int] | None, case: str) -> None:
    fmt, split = Fp8Format(block), SPLITS[case]
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    data, scales = fmt.quantize(weight)
    if block is None:
        whole = fp8_channel(data, scales, torch.float32)
    else:
        whole = fp8_block(data, scales, block, torch.float32)
    local_cols = split.stop - split.start if split.dim == 1 else COLS
    local_rows = split.stop - split.start if split.dim == 0 else ROWS
    projection = MergedLinear(local_cols, {"w": local_rows}, bias=False)
    keep_fp8(projection, fmt.block_k(local_cols))
    slot = Fp8Slot(projection, (0, local_rows), fmt, torch.float32)
    part, part_scales = slot.share(data, scales, split)
    assert torch.equal(per_row(part, part_scales, fmt.block_k(local_cols)), split.take(whole))
