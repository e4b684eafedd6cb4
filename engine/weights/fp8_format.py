"""Fp8Format: how an FP8 checkpoint scales its e4m3 weights, and the per-row scale grid an
in-format projection (engine/layers/fp8_projection.py) holds.

Two formats:
- block scales (`quant_method: fp8`, DeepSeek-V3 / Qwen3-FP8): one float32 `weight_scale_inv`
  per [block_n, block_k] tile (128 x 128), the last tile of a dimension partial;
- per-channel scales (compressed-tensors FP8): one `weight_scale` per output row ([out, 1]), or
  one for the whole tensor.

A projection keeps its scales as one float32 row per weight row, [rows, cdiv(cols, block_k)]
(a block's scale repeated over its block_n rows). It costs 4 bytes per block_k weights (3% of
the e4m3 weight at 128), and buys what the stacked and sliced weights need: q, k and v (gate
and up) stack into one weight whatever their row counts, and a tensor-parallel rank's rows of a
column-parallel weight carry their own scales wherever the split falls. A row-parallel split
must fall on a block_k boundary (a scale column may not straddle two ranks): the loader keeps a
layer whose split does not dequantized (fp8_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.weights.dequantize import e8m0_to_float32

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
KERNEL_BLOCK_K = 64  # the kernel's K step (fp8_linear_kernel.BLOCK_K): block_k is a multiple


@dataclass(frozen=True)
class Fp8Format:
    """`block`: (block_n, block_k), or None: one scale per output channel."""

    block: tuple[int, int] | None

    @property
    def scale_suffix(self) -> str:
        """The scale tensor's name suffix in the format's checkpoints (in place of `.weight`)."""
        return ".weight_scale_inv" if self.block is not None else ".weight_scale"

    def runs(self) -> bool:
        """Whether the kernel computes this format: its scale columns are whole K steps."""
        return self.block is None or self.block[1] % KERNEL_BLOCK_K == 0

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        """The scale shape a [rows, cols] weight's checkpoint holds."""
        if self.block is None:
            return (rows, 1)
        block_n, block_k = self.block
        return (-(-rows // block_n), -(-cols // block_k))

    def block_k(self, cols: int) -> int:
        """The input columns one scale covers in a layer of `cols` (local) input columns."""
        if self.block is None:  # one scale column: a whole number of kernel steps over cols
            return -(-cols // KERNEL_BLOCK_K) * KERNEL_BLOCK_K
        return self.block[1]

    def row_scales(self, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """A checkpoint's scales -> float32 [rows, scale columns], one row per weight row
        (exact: every scale dtype widens to float32 exactly). ValueError on a wrong shape."""
        grid = self.grid(rows, cols)
        per_tensor = self.block is None and scales.numel() == 1
        if not per_tensor and scales.numel() != grid[0] * grid[1]:
            raise ValueError(
                f"scales of shape {tuple(scales.shape)} do not fit a {rows}x{cols} weight "
                f"(expected {grid})"
            )
        if self.block is not None and tuple(scales.shape) != grid:
            raise ValueError(f"scale grid {tuple(scales.shape)} != {grid} for {rows}x{cols}")
        wide = e8m0_to_float32(scales)
        if self.block is None:
            return wide.reshape(-1, 1).expand(rows, 1).contiguous()
        return wide.repeat_interleave(self.block[0], dim=0)[:rows].contiguous()

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A full-precision [rows, cols] weight -> (e4m3 data, scales in the checkpoint's
        layout), amax / 448 per block or row as DeepSeek's and vLLM's quantizers do, the
        arithmetic that of transformers' (Fp8Quantize for blocks, quantize_fp8_per_row for
        channels); an all-zero block keeps scale 1."""
        w = weight.to(torch.float32)
        if self.block is None:
            amax = w.abs().amax(dim=-1, keepdim=True)
            scale = torch.where(amax > 0, amax, torch.ones_like(amax)) / E4M3_MAX
            return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
        rows, cols = w.shape
        (block_n, block_k), (grid_n, grid_k) = self.block, self.grid(rows, cols)
        padded = torch.zeros(grid_n * block_n, grid_k * block_k)
        padded[:rows, :cols] = w
        tiles = padded.view(grid_n, block_n, grid_k, block_k)
        amax = tiles.abs().amax(dim=(1, 3))
        inverse = E4M3_MAX / torch.where(amax > 0, amax, torch.ones_like(amax))
        inverse = torch.where(amax > 0, inverse, torch.ones_like(inverse))
        scaled = tiles * inverse[:, None, :, None]
        data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        data = data.view(grid_n * block_n, grid_k * block_k)[:rows, :cols].contiguous()
        return data, (1.0 / inverse).to(torch.float32)
