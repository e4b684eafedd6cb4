"""A StackedExperts' two stacks held in MXFP4 (gpt-oss's experts on CUDA), as the checkpoint
stores them, for engine/layers/mxfp4_grouped_gemm_kernel.py to read.

Each stack [experts, N, K] (StackedExperts' layout) becomes `{stack}_blocks` [experts, N, K / 2]
uint8 (two e2m1 values a byte, low nibble first) and `{stack}_scales` [experts, N, K / 32]
uint8 (E8M0): the checkpoint's `*_blocks` [experts, N, K / 32, 16] with its last two dims
merged, and its `*_scales`, byte for byte. 4.25 bits a weight instead of bfloat16's 16. They
are parameters of the experts module itself (a level-2 sleep releases them as any weight),
which its `checkpoint_tensors` does not list: they are no checkpoint tensor under these names.
"""

from __future__ import annotations

import torch
from torch import nn

STACKS = ("gate_up_proj", "down_proj")
MXFP4_BLOCK = 32  # values per scale


def register_packed(
    module: nn.Module, experts: int, shapes: dict[str, tuple[int, int]], device: torch.device
) -> None:
    """Give `module` each stack's (`shapes`: [N, K], K a multiple of 32) blocks and scales."""
    for stack, (n, k) in shapes.items():
        assert k % MXFP4_BLOCK == 0, f"{stack}: {k} input columns are not whole MXFP4 blocks"
        blocks = torch.empty(experts, n, k // 2, dtype=torch.uint8, device=device)
        scales = torch.empty(experts, n, k // MXFP4_BLOCK, dtype=torch.uint8, device=device)
        module.register_parameter(f"{stack}_blocks", nn.Parameter(blocks, requires_grad=False))
        module.register_parameter(f"{stack}_scales", nn.Parameter(scales, requires_grad=False))


def packed_stack(module: nn.Module, stack: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack `stack`'s blocks and scales (the parameters themselves)."""
    blocks: torch.Tensor = getattr(module, f"{stack}_blocks")
    scales: torch.Tensor = getattr(module, f"{stack}_scales")
    return blocks, scales
