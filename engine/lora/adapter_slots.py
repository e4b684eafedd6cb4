"""AdapterSlots: one rank's stacked adapter weights for every projection, and a slot's writes.

Every tensor-parallel rank holds its own: rank 0's AdapterRegistry decides what goes in which
slot, and every rank writes the same adapter into the same slot (the workers when rank 0 tells
them, below). A rank keeps its slice of each adapter,
cut as the base weight it attaches to is cut (engine/models/sharding.py):
- column-parallel parts (q/k/v, gate/up): B's rows of this rank's output columns, A whole, so
  the delta lands in the rank's own columns;
- row-parallel projections (o_proj, down_proj): A's columns of this rank's input slice, B
  whole; each rank adds its partial delta `B(A_r x_r)` to its partial output before the
  projection's all-reduce, which sums them: `sum_r B(A_r x_r) = B(A x)`
(engine/layers/parallel_linear.py).
With one rank nothing is cut. `share_slot` and `follow_slot` carry a slot's write from rank 0
to the others (Op.LORA on the StepChannel, then the adapter's whole tensors, each rank cutting
its own); `followed_step` builds a worker's LoRA pass from the slots a STEP carries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from engine.layers.merged_linear import MergedLinear
from engine.lora.adapter_file import AdapterFile
from engine.lora.lora_weights import LoraStep, ProjectionLora
from engine.models.base import CausalLM
from engine.parallel.step_channel import Op, StepChannel, StepHeader


class AdapterSlots:
    def __init__(self, model: CausalLM, slots: int, max_rank: int) -> None:
        self.sharding = model.sharding
        self.weights: dict[nn.Module, ProjectionLora] = {}
        # Each target by its checkpoint module name -> (its projection's weights, part index).
        self.targets: dict[str, tuple[ProjectionLora, int]] = {}
        self.shapes: dict[str, tuple[int, int]] = {}  # the same names -> whole (out, in)
        if slots:
            self._allocate(model, slots, max_rank)

    def _allocate(self, model: CausalLM, slots: int, max_rank: int) -> None:
        param = next(model.parameters())  # the weights' device and dtype
        for prefix, module in model.lora_targets().items():
            parent, _, own = prefix.rpartition(".")
            if isinstance(module, MergedLinear) and not module.fused:
                parts = module.parts
            else:  # row-parallel, or a fused projection (peft's target is the whole)
                parts = {own: module.weight.shape[0]}
            in_features = module.weight.shape[1]  # this rank's
            lora = ProjectionLora(parts, in_features, slots, max_rank, param.device, param.dtype)
            self.weights[module] = lora
            for part, (name, out) in enumerate(parts.items()):
                target = f"{parent}.{name}"
                self.targets[target] = (lora, part)
                whole = self.sharding.full_shape(f"{target}.weight", (out, in_features))
                self.shapes[target] = (whole[0], whole[1])

    def write(self, slot: int, file: AdapterFile) -> None:
        """Install `file` (whole tensors, checked against `shapes`) in `slot`: this rank's
        slices of it."""
        with torch.no_grad():
            self.clear(slot)
            for module, (a, b) in file.weights.items():
                lora, part = self.targets[module]
                split = self.sharding.split(f"{module}.weight")
                if split is not None and split.dim == 0:  # column-parallel: B's rows
                    b = split.take(b)
                elif split is not None:  # row-parallel: A's columns
                    a = split.take(a)
                lora.write(slot, part, a, b, file.scaling)

    def clear(self, slot: int) -> None:
        with torch.no_grad():
            for lora in self.weights.values():
                lora.clear(slot)

    def step(
        self,
        slots: np.ndarray,
        query_lens: Sequence[int] | np.ndarray,
        device: torch.device,
        triton: bool = False,
    ) -> LoraStep:
        """The LoRA pass of a step whose requests (packed in order, `query_lens` tokens each)
        run the adapters in `slots` (-1: the base model), grouped by slot; `triton`: with the
        segmented kernel (engine/lora/lora_kernel.py)."""
        token_slots = np.repeat(slots, np.asarray(query_lens))  # [tokens]
        groups = []
        for slot in sorted(set(slots.tolist()) - {-1}):
            rows = torch.from_numpy(np.flatnonzero(token_slots == slot))
            groups.append((slot, rows.to(device, non_blocking=True)))
        return LoraStep(groups, self.weights, triton)


def share_slot(channel: StepChannel, slot: int, file: AdapterFile | None) -> None:
    """Rank 0: tell every other rank to write `file` (None: clear) into `slot`, in order
    with the steps it sends."""
    channel.send(StepHeader(Op.LORA))
    channel.tp.broadcast_object((slot, file))


def follow_slot(channel: StepChannel, slots: AdapterSlots) -> None:
    """A worker, after Op.LORA: the same write as rank 0's, of this rank's slices."""
    slot, file = channel.tp.broadcast_object()
    if file is None:
        slots.clear(slot)
    else:
        slots.write(slot, file)


def followed_step(
    channel: StepChannel, slots: AdapterSlots, num_seqs: int, device: torch.device
) -> LoraStep:
    """A worker: the LoRA pass of the STEP just received (its slots came with it)."""
    starts = channel.arrays.query_start_loc[: num_seqs + 1]
    return slots.step(channel.lora_slots[:num_seqs], np.diff(starts), device)
