"""Which projections of a model stay in FP8 (and where their scales are), and this rank's
share of an in-format tensor: what loading and weight updates write into them.

`keep_in_format` runs at build, on the meta device, when the layers run Triton
(engine/layers/kernel_choice.py): each MergedLinear and RowParallelLinear whose checkpoint
tensors are all FP8 (e4m3 data, block or per-channel scales: fp8_format.py) becomes an
in-format projection (engine/layers/fp8_projection.py). A projection stays dequantized (as on
the CPU) when the kernel would not compute exactly what dequantization gives:
- a row-parallel split that does not fall on a block_k boundary (a scale column would straddle
  two ranks): the layer is dequantized, not refused, so every split that loads today still does;
- e5m2 data, or a block_k that is not a whole number of the kernel's K steps (64);
- per-channel scales in a dtype narrower than the served one (the format's reference rounds
  the product in the scale's dtype; the kernel's float32 product does not).
Projections are named as the model's modules are (a merged one's parts under its parent, as
checkpoint_tensors names them); a family that renames modules for its checkpoints (Gemma 4)
finds no match and stays dequantized. The MoE experts stay dequantized.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.fp8_projection import keep_fp8
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import RowParallelLinear
from engine.parallel.shard_layout import ShardLayout, Split
from engine.weights.checkpoint_reader import CheckpointReader
from engine.weights.fp8_format import Fp8Format
from engine.weights.quantization import Quantization, read_quantization

Projection = MergedLinear | RowParallelLinear
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def checkpoint_format(quantization: Quantization | None) -> Fp8Format | None:
    """The FP8 format a checkpoint's quantization stores its projections in (None: not FP8)."""
    if quantization is None:
        return None
    if quantization.method == "fp8":
        return Fp8Format(quantization.block)
    return Fp8Format(None) if quantization.method == "compressed-tensors" else None


@dataclass(frozen=True)
class Fp8Slot:
    """One in-format checkpoint tensor of this rank (engine/weights/in_format.py's InFormat):
    its e4m3 rows and their scales' rows, and their format."""

    projection: Projection
    rows: tuple[int, int]  # its rows in the projection's weight
    fmt: Fp8Format
    served: torch.dtype  # the model's dtype: what a full-precision update of it is given in

    # NOTE: views made on demand: none can be made of a weight a level-2 sleep released.
    @property
    def data(self) -> torch.Tensor:  # [rows, cols] e4m3
        return self.projection.weight.detach()[self.rows[0] : self.rows[1]]

    @property
    def scale(self) -> torch.Tensor:  # [rows, scale columns] float32 (a buffer: never released)
        assert self.projection.weight_scale is not None
        return self.projection.weight_scale[self.rows[0] : self.rows[1]]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.projection.weight.shape[1])

    def parts(self, name: str) -> tuple[str, str]:
        """The checkpoint names of its data and scales (the data's is the tensor's own)."""
        return name, name.removesuffix(".weight") + self.fmt.scale_suffix

    def is_data(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of `dtype` under the tensor's own name is quantized data."""
        return dtype == torch.float8_e4m3fn

    def write(self, share: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.data.copy_(share[0])
        self.scale.copy_(share[1])

    def share(
        self, data: torch.Tensor, scales: torch.Tensor, split: Split | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole tensor's e4m3 data and its scales (the checkpoint's layout) -> this rank's
        data and per-row scales. ValueError names what does not fit."""
        if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
            raise ValueError(f"FP8 data is a 2-d float8_e4m3fn tensor, not {data.dtype}")
        rows, cols = data.shape
        row_scales = self.fmt.row_scales(scales, rows, cols)
        if split is None:
            return fitting(data, self.shape), row_scales
        if split.dim == 0 or self.fmt.block is None:  # rows carry their scales with them
            scale_part = split.take(row_scales) if split.dim == 0 else row_scales
            return fitting(split.take(data), self.shape), scale_part
        block_k = self.fmt.block[1]  # keep_in_format checked the split falls on it
        scale_part = row_scales[:, split.start // block_k : -(-split.stop // block_k)]
        return fitting(split.take(data), self.shape), scale_part

    def quantize(
        self, weight: torch.Tensor, split: Split | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole full-precision tensor, quantized to the format (whole, so every rank's
        share is the one rank's), then this rank's share."""
        return self.share(*self.fmt.quantize(weight), split)


def fitting(part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`part`, if it has this rank's `shape`; else ValueError naming both."""
    if tuple(part.shape) != tuple(shape):
        raise ValueError(f"shape {tuple(part.shape)} != served shape {tuple(shape)}")
    return part


def fp8_slots(model: nn.Module, served: torch.dtype) -> dict[str, Fp8Slot]:
    """The model's in-format FP8 projections' tensors by checkpoint name (empty: none)."""
    config = getattr(model, "config", None)
    fmt = checkpoint_format(read_quantization(config.raw)) if config is not None else None
    if fmt is None:
        return {}
    slots: dict[str, Fp8Slot] = {}
    for module, names in _projections(model):
        if module.weight_scale is not None:
            for name, rows in names.items():
                slots[name] = Fp8Slot(module, rows, fmt, served)
    return slots


def keep_fp8_projections(model: nn.Module, reader: CheckpointReader, dtype: torch.dtype) -> int:
    """Make in-format every projection the kernel computes exactly (see above); the count."""
    fmt = checkpoint_format(reader.quantization)
    if fmt is None or not fmt.runs():
        return 0
    sharding: ShardLayout = model.sharding  # type: ignore[assignment]
    kept = 0
    for module, names in _projections(model):
        if all(_fits(reader, sharding, fmt, name, dtype) for name in names):
            keep_fp8(module, fmt.block_k(module.weight.shape[1]))
            kept += 1
    return kept


def _fits(
    reader: CheckpointReader, sharding: ShardLayout, fmt: Fp8Format, name: str, dtype: torch.dtype
) -> bool:
    parts = reader.groups.get(name, ())
    if len(parts) != 2 or reader.dtype(name) != "F8_E4M3":
        return False
    if fmt.block is None:
        scale_dtype = reader.part_dtype(parts[1])
        return scale_dtype in ("F32", SAFETENSORS_DTYPES.get(dtype))
    for rank in range(sharding.size):
        split = sharding.for_rank(rank).split(name)
        if split is not None and split.dim == 1 and (split.rest or split.start % fmt.block[1]):
            return False
    return True


def _projections(model: nn.Module) -> Iterator[tuple[Projection, dict[str, tuple[int, int]]]]:
    """Each projection, with its checkpoint tensors' names -> their rows in its weight."""
    for prefix, module in model.named_modules():
        if isinstance(module, MergedLinear) and not module.fused:
            parent, start, names = prefix.rpartition(".")[0], 0, {}
            for part, rows in zip(module.parts, module.sizes, strict=True):
                names[f"{parent}.{part}.weight".lstrip(".")] = (start, start + rows)
                start += rows
            yield module, names
        elif isinstance(module, Projection):
            yield module, {f"{prefix}.weight": (0, module.weight.shape[0])}
