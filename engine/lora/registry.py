"""AdapterRegistry: the LoRA adapters resident in the model, by name, each in a slot.

`max_loras` slots of stacked weights per projection (engine/lora/lora_weights.py) are
allocated at start (none when it is 0). Loading reads and checks the whole adapter before it
writes anything, so one that does not fit changes nothing. Every load gets a new `key`: a
request holds its adapter's key (the prefix cache folds it into its hashes, so KV computed
under one adapter is never reused under another, nor under a later adapter of the same name),
and a step looks up each key's slot.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.lora.adapter_file import read_adapter
from engine.lora.lora_weights import LoraStep, ProjectionLora
from engine.models.llama import LlamaForCausalLM, RowParallelLinear
from engine.models.merged_linear import MergedLinear
from engine.scheduling.request import Request


@dataclass(frozen=True)
class ResidentAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    key: int  # this load's identity (never 0, the base model's)
    slot: int


class AdapterRegistry:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.resident: dict[str, ResidentAdapter] = {}
        self.slot_of_key: dict[int, int] = {}
        self.weights: dict[nn.Module, ProjectionLora] = {}
        # Each target by its checkpoint module name -> (its projection's weights, part index).
        self.targets: dict[str, tuple[ProjectionLora, int]] = {}
        self.shapes: dict[str, tuple[int, int]] = {}  # the same names -> (out, in)
        self._keys = itertools.count(1)
        if max_loras:
            self._allocate(model)

    def _allocate(self, model: LlamaForCausalLM) -> None:
        param = model.model.embed_tokens.weight
        for prefix, module in model.named_modules():
            parent, _, own = prefix.rpartition(".")
            if isinstance(module, MergedLinear):
                parts = module.parts
            elif isinstance(module, RowParallelLinear):
                parts = {own: module.weight.shape[0]}
            else:
                continue
            in_features = module.weight.shape[1]
            lora = ProjectionLora(
                parts, in_features, self.max_loras, self.max_rank, param.device, param.dtype
            )
            self.weights[module] = lora
            for part, (name, out) in enumerate(parts.items()):
                self.targets[f"{parent}.{name}"] = (lora, part)
                self.shapes[f"{parent}.{name}"] = (out, in_features)

    def load(self, name: str, path: str | Path) -> ResidentAdapter:
        """Make the adapter at `path` resident as `name`. ValueError (nothing changed) when
        the name is taken or empty, every slot is taken, or the adapter does not fit."""
        if not name:
            raise ValueError("adapter name: must not be empty (the base model's)")
        if name in self.resident:
            raise ValueError(f"adapter {name!r}: already loaded")
        if not self.max_loras:
            raise ValueError("max_loras is 0: this engine serves no LoRA adapters")
        adapter = read_adapter(path, self.shapes, self.max_rank)
        taken = {a.slot for a in self.resident.values()}
        free = [slot for slot in range(self.max_loras) if slot not in taken]
        if not free:
            raise ValueError(
                f"adapter {name!r}: max_loras={self.max_loras} adapters are resident; "
                "unload one first"
            )
        slot = free[0]
        with torch.no_grad():
            for module, (a, b) in adapter.weights.items():
                lora, part = self.targets[module]
                lora.write(slot, part, a, b, adapter.scaling)
        key = next(self._keys)
        resident = ResidentAdapter(name, str(path), adapter.rank, adapter.scaling, key, slot)
        self.resident[name] = resident
        self.slot_of_key[key] = slot
        return resident

    def unload(self, name: str) -> None:
        """Free `name`'s slot. ValueError when it is not loaded. The caller makes sure no
        request runs it."""
        resident = self.resident.pop(name, None)
        if resident is None:
            raise ValueError(f"adapter {name!r}: not loaded")
        del self.slot_of_key[resident.key]
        with torch.no_grad():
            for lora in self.weights.values():
                lora.clear(resident.slot)

    def key_of(self, name: str) -> int | None:
        """The key of the resident adapter `name`; 0 for "" (the base model); None if absent."""
        if not name:
            return 0
        resident = self.resident.get(name)
        return None if resident is None else resident.key

    def step(
        self, requests: Sequence[Request], query_lens: Sequence[int], device: torch.device
    ) -> LoraStep | None:
        """The LoRA pass of a step feeding `query_lens` tokens of each request (packed in
        order), or None when no request has an adapter."""
        if not self.slot_of_key:
            return None
        slots = [self.slot_of_key[r.adapter_key] if r.adapter_key else -1 for r in requests]
        if max(slots) < 0:
            return None
        token_slots = np.repeat(np.asarray(slots), np.asarray(query_lens))  # [tokens]
        groups = []
        for slot in sorted(set(slots) - {-1}):
            rows = torch.from_numpy(np.flatnonzero(token_slots == slot))
            groups.append((slot, rows.to(device, non_blocking=True)))
        return LoraStep(groups, self.weights)
