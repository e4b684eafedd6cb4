"""gpt-oss's MXFP4 experts kept packed (engine/moe/packed_experts.py) when the layers run
Triton (CUDA): which experts stay so, this rank's share of a packed stack, and the OCP MX
quantizer that full-precision updates go through.

`keep_mxfp4_experts` runs at build, on the meta device: every fused StackedExperts (gpt-oss's)
whose two stacks the checkpoint stores as `*_blocks` + `*_scales` is packed, unless a
tensor-parallel split of the down projection's input (intermediate) dimension falls inside a
32-value block (a scale would straddle two ranks): then it stays dequantized, as on the CPU.
A rank's share of gate_up_proj is its output rows (with their scales), of down_proj its input
columns, in whole blocks with their scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.moe.experts import StackedExperts
from engine.moe.packed_experts import MXFP4_BLOCK, STACKS, packed_stack
from engine.parallel.shard_layout import ShardLayout, Split
from engine.weights.checkpoint_reader import CheckpointReader
from engine.weights.dequantize import E2M1_VALUES, E8M0_BIAS
from engine.weights.fp8_layers import fitting

E2M1_MAGNITUDES = torch.tensor(E2M1_VALUES[:8])
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2^2


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert stack as transformers holds it, [experts, in, out] (in a multiple of 32) ->
    blocks [experts, out, in / 32, 16] and scales [experts, out, in / 32], uint8, as the OCP MX
    spec quantizes: per 32 values an E8M0 exponent floor(log2(amax)) - 2, the values divided by
    2^exponent rounded to the nearest e2m1 (saturating at 6), two nibbles a byte, low first."""
    experts, inputs, out = weight.shape
    if inputs % MXFP4_BLOCK:
        raise ValueError(f"input dim {inputs} is not a multiple of {MXFP4_BLOCK}")
    groups = weight.float().transpose(1, 2).reshape(experts, out, -1, MXFP4_BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax > 0, amax.log2().floor() - E2M1_MAX_EXPONENT, -127.0)
    exponent = exponent.clamp(-127, 127)
    scaled = groups / exponent.exp2()
    magnitude = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(dim=-1)
    nibbles = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


@dataclass(frozen=True)
class Mxfp4Slot:
    """One packed stack of this rank (engine/weights/in_format.py's InFormat)."""

    experts: StackedExperts
    stack: str  # "gate_up_proj" or "down_proj"
    served: torch.dtype

    def parts(self, name: str) -> tuple[str, str]:
        return f"{name}_blocks", f"{name}_scales"

    def is_data(self, dtype: torch.dtype) -> bool:
        return False  # the data is always `*_blocks`: the name itself is full precision

    def share(
        self, data: torch.Tensor, scales: torch.Tensor, split: Split | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole `*_blocks` [experts, out, groups, 16] and `*_scales` [experts, out, groups]
        -> this rank's packed blocks and scales. `split` is the model tensor's ([experts, in,
        out]): dim 2 takes output rows, dim 1 input groups."""
        if data.dtype != torch.uint8 or scales.dtype != torch.uint8 or data.dim() != 4:
            raise ValueError(
                f"MXFP4 blocks {tuple(data.shape)} {data.dtype} and scales {scales.dtype}: "
                "uint8, [experts, out, groups, 16] and [experts, out, groups]"
            )
        if tuple(data.shape[:3]) != tuple(scales.shape):
            raise ValueError(f"blocks {tuple(data.shape)} and scales {tuple(scales.shape)} differ")
        if split is not None and split.dim == 2:
            data, scales = data[:, split.start : split.stop], scales[:, split.start : split.stop]
        elif split is not None:  # keep_mxfp4_experts checked it falls on whole groups
            groups = slice(split.start // MXFP4_BLOCK, split.stop // MXFP4_BLOCK)
            data, scales = data[:, :, groups], scales[:, :, groups]
        blocks, scale_target = packed_stack(self.experts, self.stack)
        packed = data.reshape(*data.shape[:2], -1)
        return fitting(packed, tuple(blocks.shape)), fitting(scales, tuple(scale_target.shape))

    def quantize(
        self, weight: torch.Tensor, split: Split | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.share(*quantize_mxfp4(weight), split)

    def write(self, share: tuple[torch.Tensor, torch.Tensor]) -> None:
        blocks, scales = packed_stack(self.experts, self.stack)
        blocks.detach().copy_(share[0])
        scales.detach().copy_(share[1])


def mxfp4_slots(model: nn.Module, served: torch.dtype) -> dict[str, Mxfp4Slot]:
    """The model's packed expert stacks by checkpoint name (empty: none)."""
    return {
        f"{prefix}.{stack}": Mxfp4Slot(module, stack, served)
        for prefix, module in model.named_modules()
        if isinstance(module, StackedExperts) and module.packed
        for stack in STACKS
    }


def keep_mxfp4_experts(model: nn.Module, reader: CheckpointReader) -> int:
    """Pack every gpt-oss expert block the checkpoint stores in MXFP4 (see above); the count."""
    q = reader.quantization
    if q is None or q.method != "mxfp4":
        return 0
    sharding: ShardLayout = model.sharding  # type: ignore[assignment]
    kept = 0
    for prefix, module in model.named_modules():
        if not (isinstance(module, StackedExperts) and module.parts is None and module.triton):
            continue
        names = [f"{prefix}.{stack}" for stack in STACKS]
        if all(len(reader.groups.get(n, ())) == 2 for n in names) and _splits_fit(
            sharding, names[1]
        ):
            module.keep_mxfp4()
            kept += 1
    return kept


def _splits_fit(sharding: ShardLayout, down: str) -> bool:
    for rank in range(sharding.size):
        split = sharding.for_rank(rank).split(down)
        if split is not None and split.dim == 1 and split.start % MXFP4_BLOCK:
            return False
    return True
