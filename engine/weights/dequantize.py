"""The dequantization of the quantized checkpoint formats Sluice loads, bit for bit as their
references compute it.

- FP8 with block scales (`quant_method: fp8`, DeepSeek-V3 / Qwen3-FP8): e4m3 weights, one
  float32 `weight_scale_inv` per [block_n, block_k] tile (128 x 128), the last tile of a row or
  column partial when the dimension is not a multiple (DeepSeek's `weight_dequant` kernel and
  transformers' FP8Linear size the scale grid by ceil-division). The product is taken in
  float32 and rounded once to the served dtype (transformers' Fp8Dequantize, DeepSeek's kernel).
  `ue8m0` scales (float8_e8m0fnu or their raw bytes) are powers of two, widened exactly first.
- compressed-tensors FP8 (`float-quantized` / `naive-quantized`): e4m3 weights, a
  `weight_scale` per output channel [out, 1] (or one per tensor). The format's reference
  (compressed_tensors' `dequantize`) widens the weight to the scale's dtype and multiplies
  there, then casts to the model's dtype: a bfloat16 scale rounds the product in bfloat16.
- MXFP4 (gpt-oss's experts): `*_blocks` [..., out, groups, 16] uint8, two e2m1 values a byte
  (low nibble first), and `*_scales` [..., out, groups] uint8 E8M0 exponents (2^(s - 127)) of
  32 values each; the result is laid out as transformers' gpt-oss experts hold it, [experts,
  in, out] (transformers' `convert_moe_packed_tensors`: the e2m1 table in the target dtype,
  then `ldexp`).
"""

from __future__ import annotations

import torch

# e2m1 (FP4) values by nibble: sign bit 3, then two exponent bits and one mantissa bit.
_E2M1_POSITIVE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1_POSITIVE + tuple(-v for v in _E2M1_POSITIVE)
E8M0_BIAS = 127
MXFP4_BLOCK = 32  # values sharing one scale (16 bytes)


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales (float8_e8m0fnu, or their biased exponents as uint8) as float32,
    exactly; any other float dtype is widened."""
    if scales.dtype == torch.uint8:
        return (scales.to(torch.float32) - E8M0_BIAS).exp2()
    return scales.to(torch.float32)


def fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """[rows, cols] e4m3 weight times its [ceil(rows/bn), ceil(cols/bk)] block scales, in
    `dtype`."""
    rows, cols = weight.shape[-2:]
    block_n, block_k = block
    grid = (-(-rows // block_n), -(-cols // block_k))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(
            f"scale grid {tuple(scale_inv.shape)} does not tile a {rows}x{cols} weight in "
            f"{block_n}x{block_k} blocks (expected {grid})"
        )
    scale = e8m0_to_float32(scale_inv)
    scale = scale.repeat_interleave(block_n, dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block_k, dim=-1)[..., :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


def fp8_channel(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] e4m3 weight times its per-channel [out, 1] (or per-tensor) scale, in `dtype`,
    the product in the scale's dtype (compressed_tensors' dequantize)."""
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(
            f"weight_scale of shape {tuple(scale.shape)} is neither per channel "
            f"([{weight.shape[0]}, 1]) nor per tensor"
        )
    scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1)
    return (weight.to(scale.dtype) * scale).to(dtype)


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[experts, out, groups, 16] e2m1 nibbles and [experts, out, groups] E8M0 scales ->
    [experts, groups * 32, out] in `dtype` (the input dim before the output dim, as
    transformers' gpt-oss experts multiply `x @ W`)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype}/{scales.dtype}")
    if blocks.dim() != 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            "([experts, out, groups, 16] and [experts, out, groups])"
        )
    experts, out, groups, width = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    values = torch.empty(experts, out, groups, width * 2, dtype=dtype)
    values[..., 0::2] = table[(blocks & 0x0F).int()]
    values[..., 1::2] = table[(blocks >> 4).int()]
    exponents = scales.to(torch.int32) - E8M0_BIAS
    # NOTE: ldexp as transformers calls it (the table value times 2^e, rounded to `dtype`):
    # not a multiply by a precomputed float scale, which 2^-127 and 2^128 would not survive.
    torch.ldexp(values, exponents[..., None], out=values)
    return values.reshape(experts, out, groups * width * 2).transpose(1, 2).contiguous()
