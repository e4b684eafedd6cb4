"""The MXFP4 grouped GEMM (engine/layers/mxfp4_grouped_gemm_kernel.py) equals the grouped GEMM
on the dequantized weights (engine/weights/dequantize.py's `mxfp4`, which is transformers'
dequantization bit for bit): every nibble, extreme scales (2^-127, 2^125), experts with no
pairs, float32 through Triton's interpreter on the CPU (compiled on CUDA).

NOTE: `use_triton` runs at collection: it chooses the interpreter before triton is imported.
"""

from __future__ import annotations

import pytest
import torch

from engine.weights.dequantize import mxfp4
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

from engine.layers.grouped_gemm_kernel import group_blocks, grouped_gemm  # noqa: E402
from engine.layers.mxfp4_grouped_gemm_kernel import mxfp4_grouped_gemm  # noqa: E402


def packed(experts: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (every byte value) and scales near 2^0, with the extremes in places."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 131, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    scales[0, 0, 0], scales[0, 1, 0] = 0, 252  # 2^-127 (subnormal); 2^125 (6 * 2^125 < max)
    return blocks, scales


@pytest.mark.parametrize(("experts", "n", "k", "tokens"), [(4, 96, 64, 7), (3, 64, 128, 1)])
def test_mxfp4_grouped_gemm_equals_the_dequantized_grouped_gemm(
    experts: int, n: int, k: int, tokens: int
) -> None:
    blocks, scales = packed(experts, n, k, seed=n + k)
    weight = mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()  # [E, N, K]
    gen = torch.Generator().manual_seed(tokens)
    a = torch.randn(tokens, k, generator=gen) * 1e-3
    ids = torch.randint(0, experts - 1, (tokens * 2,), generator=gen)  # the last one: no pairs
    order = ids.argsort(stable=True)
    rows = order // 2
    counts = torch.bincount(ids, minlength=experts)
    dev = torch.device(DEVICE)
    starts = group_blocks(counts.to(dev))
    expected = grouped_gemm(a.to(dev), rows.to(dev), weight.to(dev), *starts)
    packed_blocks = blocks.reshape(experts, n, k // 2).to(dev)
    got = mxfp4_grouped_gemm(a.to(dev), rows.to(dev), packed_blocks, scales.to(dev), *starts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
