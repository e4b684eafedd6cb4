"""The dequantization of each quantized format equals its reference bit for bit: transformers'
own (Fp8Dequantize, its FP8Linear's `_dequantize_fp8_weight` for partial blocks, gpt-oss's
`convert_moe_packed_tensors`) and compressed_tensors' `dequantize`, on random data."""

from __future__ import annotations

import pytest
import torch

from engine.weights import dequantize

FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits: equal bits, equal tensors (NaN and -0.0 included)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def random_fp8(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * 100).clamp(-448, 448).to(FP8)


def fp8_dequantize_op() -> object:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(256, 384), (128, 128)])
def test_fp8_block_equals_transformers_fp8_dequantize(
    rows: int, cols: int, dtype: torch.dtype
) -> None:
    weight = random_fp8(rows, cols, seed=rows + cols)
    scale_inv = torch.rand(rows // 128, cols // 128, generator=torch.Generator().manual_seed(1))
    ours = dequantize.fp8_block(weight, scale_inv, (128, 128), dtype)
    theirs = fp8_dequantize_op()._dequantize_one(weight, scale_inv, output_dtype=dtype)  # type: ignore[attr-defined]
    assert ours.dtype == dtype
    assert torch.equal(bits(ours), bits(theirs))


def test_fp8_partial_blocks_equal_transformers_fp8_linear_weight() -> None:
    """192 x 200: the last block of each dim is partial (64 rows, 72 columns), as the format
    and transformers' FP8Linear size the grid (ceil-division)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = random_fp8(192, 200, seed=3)
    scale_inv = torch.rand(2, 2, generator=torch.Generator().manual_seed(2))
    ours = dequantize.fp8_block(weight, scale_inv, (128, 128), torch.float32)
    theirs = _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.float32)
    assert torch.equal(bits(ours), bits(theirs))


def test_fp8_ue8m0_scales_as_bytes_equal_their_float8_e8m0_values() -> None:
    weight = random_fp8(256, 128, seed=4)
    raw = torch.randint(100, 140, (2, 1), dtype=torch.uint8)
    from_bytes = dequantize.fp8_block(weight, raw, (128, 128), torch.float32)
    from_e8m0 = dequantize.fp8_block(
        weight, raw.view(torch.float8_e8m0fnu), (128, 128), torch.float32
    )
    theirs = fp8_dequantize_op()._dequantize_one(weight, raw, output_dtype=torch.float32)  # type: ignore[attr-defined]
    assert torch.equal(bits(from_bytes), bits(theirs))
    assert torch.equal(bits(from_e8m0), bits(theirs))


def test_fp8_scale_grid_that_does_not_tile_the_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="does not tile"):
        dequantize.fp8_block(random_fp8(256, 128, 0), torch.ones(1, 1), (128, 128), torch.float32)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_channel_equals_compressed_tensors_dequantize(
    scale_dtype: torch.dtype, dtype: torch.dtype, strategy: str
) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    weight = random_fp8(96, 64, seed=5)
    rows = 96 if strategy == "channel" else 1
    scale = (torch.rand(rows, 1, generator=torch.Generator().manual_seed(6)) / 100).to(scale_dtype)
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)
    theirs = ct_dequantize(weight, scale, None, args).to(dtype)
    ours = dequantize.fp8_channel(weight, scale, dtype)
    assert torch.equal(bits(ours), bits(theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_equals_transformers_convert_moe_packed_tensors(dtype: torch.dtype) -> None:
    """Every nibble and every scale byte (0..255: 2^-127 .. 2^128, where the products
    underflow, overflow and turn 0 * inf into NaN) in random blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 40, 4), generator=gen, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 127, 254, 255], dtype=torch.uint8)
    ours = dequantize.mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == (3, 4 * 32, 40)
    assert torch.equal(bits(ours), bits(theirs))


def test_mxfp4_blocks_and_scales_that_do_not_match_are_refused() -> None:
    blocks = torch.zeros(2, 8, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        dequantize.mxfp4(blocks, torch.zeros(2, 8, 2, dtype=torch.uint8), torch.float32)
