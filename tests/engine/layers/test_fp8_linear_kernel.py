"""The FP8 block-scaled linear kernel equals the dequantized reference (engine/weights/
dequantize.py's fp8_block, then F.linear) in float32: compiled on CUDA, else on the CPU through
Triton's interpreter. Shapes: whole 128 x 128 blocks, partial last blocks in both dimensions,
decode (1 row) and prefill row counts, with and without a bias; the weights quantized by
transformers' own Fp8Quantize.

NOTE: `use_triton` runs at collection: it chooses the interpreter before triton is imported.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.weights.dequantize import fp8_block
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

from engine.layers.fp8_linear_kernel import fp8_block_linear  # noqa: E402


def quantized(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' block-128 quantization of a random [n, k] weight (whole blocks: it leaves
    other shapes alone), then cut to shape when asked for partial ones."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    gen = torch.Generator().manual_seed(seed)
    whole = (-(-n // 128) * 128, -(-k // 128) * 128)
    weight = torch.randn(*whole, generator=gen) * 0.05
    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    parts = op._quantize_one("w.weight", weight)
    return parts["w.weight"][:n, :k].contiguous(), parts["w.weight_scale_inv"]


@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"),
    [(1, 256, 256, False), (7, 384, 128, True), (33, 200, 320, False), (5, 64, 192, True)],
)
def test_fp8_block_linear_equals_the_dequantized_reference(
    rows: int, n: int, k: int, bias: bool
) -> None:
    weight, scale_inv = quantized(n, k, seed=n + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    expected = F.linear(x, fp8_block(weight, scale_inv, (128, 128), torch.float32), b)
    dev = torch.device(DEVICE)
    got = fp8_block_linear(
        x.to(dev),
        weight.to(dev),
        scale_inv.to(dev),
        (128, 128),
        None if b is None else b.to(dev),
    )
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
