"""An in-format FP8 projection (engine/layers/fp8_projection.py) computes what its dequantized
weight computes: merged parts of any row count and a row-parallel projection, with block-128
scales (partial blocks included) and per-channel ones, each part quantized on its own as the
checkpoints store it (transformers' quantizers), float32 through Triton's interpreter on the
CPU (compiled on CUDA).

NOTE: `use_triton` runs at collection: it chooses the interpreter before triton is imported.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.fp8_projection import keep_fp8
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import RowParallelLinear
from engine.parallel.tensor_parallel import TensorParallel
from engine.weights.dequantize import fp8_block, fp8_channel
from engine.weights.fp8_format import Fp8Format
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

FORMATS = {"block": Fp8Format((128, 128)), "channel": Fp8Format(None)}


def dequantized(fmt: Fp8Format, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if fmt.block is None:
        return fp8_channel(data, scales, torch.float32)
    return fp8_block(data, scales, fmt.block, torch.float32)


def fill(
    module: MergedLinear | RowParallelLinear, fmt: Fp8Format, parts: list[int]
) -> torch.Tensor:
    """Quantize a random weight part by part into the in-format `module`; the dequantized
    weight it must compute with."""
    gen = torch.Generator().manual_seed(sum(parts))
    cols = module.weight.shape[1]
    keep_fp8(module, fmt.block_k(cols))
    assert module.weight_scale is not None
    reference, start = [], 0
    for rows in parts:
        data, scales = fmt.quantize(torch.randn(rows, cols, generator=gen) * 0.05)
        module.weight.data[start : start + rows] = data
        module.weight_scale[start : start + rows] = fmt.row_scales(scales, rows, cols)
        reference.append(dequantized(fmt, data, scales))
        start += rows
    return torch.cat(reference)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("tokens", [1, 19])
def test_merged_parts_in_fp8_equal_their_dequantized_weights(fmt: str, tokens: int) -> None:
    parts = {"q_proj": 256, "k_proj": 64, "v_proj": 64}  # k and v: half a block each
    module = MergedLinear(320, parts, bias=True)  # 320 input columns: a partial last block
    weight = fill(module, FORMATS[fmt], list(parts.values()))
    module = module.to(DEVICE)
    x = torch.randn(tokens, 320, generator=torch.Generator().manual_seed(tokens))
    assert module.bias is not None
    expected = F.linear(x, weight, module.bias.detach())
    got = module(x.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_row_parallel_projection_in_fp8_equals_its_dequantized_weight(fmt: str) -> None:
    module = RowParallelLinear(384, 200, bias=True, tp=TensorParallel())
    weight = fill(module, FORMATS[fmt], [200])
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(5))
    assert module.bias is not None
    expected = F.linear(x, weight, module.bias.detach())
    got = module.to(DEVICE)(x.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
