"""Checkpoint tensors a model holds in their quantized format (FP8 projections on CUDA:
fp8_layers.py; MXFP4 experts on CUDA: mxfp4_experts.py), as loading and weight updates see
them: each an `InFormat` slot, by the model's (checkpoint) name.

A slot's tensor is given to it in one of two forms: quantized, as its checkpoints store it (its
data and its scales, two checkpoint tensors: `parts`), which `share` cuts to this rank's share
as it is; or in full precision (the served dtype), which `quantize` quantizes whole to the
format before cutting, so every rank count serves the same values. `write` copies a share in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from engine.parallel.shard_layout import Split
from engine.weights.checkpoint_reader import CheckpointReader
from engine.weights.fp8_layers import fp8_slots, keep_fp8_projections
from engine.weights.mxfp4_experts import keep_mxfp4_experts, mxfp4_slots

Share = tuple[torch.Tensor, torch.Tensor]  # this rank's data and scales, in the slot's layout


class InFormat(Protocol):
    @property
    def served(self) -> torch.dtype:
        """The model's dtype: what a full-precision tensor is given in."""
        ...

    def parts(self, name: str) -> tuple[str, str]:
        """The checkpoint names of tensor `name`'s data and scales."""
        ...

    def is_data(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of `dtype` under `name` itself is quantized data (else full
        precision)."""
        ...

    def share(self, data: torch.Tensor, scales: torch.Tensor, split: Split | None) -> Share:
        """Whole data and scales as stored -> this rank's share; ValueError names a misfit."""
        ...

    def quantize(self, weight: torch.Tensor, split: Split | None) -> Share:
        """A whole full-precision tensor, quantized to the format, then this rank's share."""
        ...

    def write(self, share: Share) -> None: ...


class InFormatTensors:
    """A model's in-format tensors: `slots` by name, and which checkpoint tensors are parts of
    them."""

    def __init__(self, slots: Mapping[str, InFormat]) -> None:
        self.slots = dict(slots)
        self._parts = {  # a part not named as its tensor -> (the tensor, 0 data | 1 scales)
            part: (name, index)
            for name, slot in self.slots.items()
            for index, part in enumerate(slot.parts(name))
            if part != name
        }

    def __bool__(self) -> bool:
        return bool(self.slots)

    def part(self, name: str, dtype: torch.dtype) -> tuple[str, int] | None:
        """(the in-format tensor, 0 for its data or 1 for its scales) that checkpoint tensor
        `name` of `dtype` is a part of; None: none (full precision, or no slot's)."""
        if name in self._parts:
            return self._parts[name]
        slot = self.slots.get(name)
        return (name, 0) if slot is not None and slot.is_data(dtype) else None

    def served(self, name: str, param: torch.Tensor) -> torch.dtype:
        """The dtype a full-precision update of parameter `name` is given in."""
        slot = self.slots.get(name)
        return param.dtype if slot is None else slot.served


def in_format(model: nn.Module) -> InFormatTensors:
    """The model's in-format tensors (none: empty). No views are made (a level-2 sleep may
    have released the weights)."""
    floats = (p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    served = next((d for d in floats if d.itemsize > 1), torch.float32)
    return InFormatTensors({**fp8_slots(model, served), **mxfp4_slots(model, served)})


def keep_in_format(model: nn.Module, reader: CheckpointReader, dtype: torch.dtype) -> int:
    """At build (on the meta device, after the dtype cast): make in format what the kernels
    compute exactly; the count of modules made so."""
    return keep_fp8_projections(model, reader, dtype) + keep_mxfp4_experts(model, reader)
