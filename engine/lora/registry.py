"""AdapterRegistry: the LoRA adapters loaded by name, and which of them are resident in slots.

`max_loras` slots of stacked weights per projection (engine/lora/lora_weights.py) are
allocated at start (none when it is 0). Loading reads and checks the whole adapter before it
changes anything, so one that does not fit changes nothing; a loaded adapter's weights stay on
the host, and it is resident while it holds a slot. Any number can be loaded: one without a
slot takes a free one, or the least recently used one whose adapter is neither pinned nor run
by a running request; when there is none, its requests wait in the queue (the scheduler asks
`make_resident` before admitting one) until a running adapter's requests are done. Pinned
adapters keep their slots and may not fill them all (one is always left to rotate).

Every load gets a new `key`: a request holds its adapter's key (the prefix cache folds it into
its hashes, so KV computed under one adapter is never reused under another, nor under a later
adapter of the same name), and a step looks up each key's slot. Slot writes go through
`run_on_device`, ordered after the steps already launched (an overlapped step in flight reads
the slot's old weights, never half-written ones).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.lora.adapter_file import TARGETS, AdapterFile, read_adapter
from engine.lora.lora_weights import LoraStep, ProjectionLora
from engine.models.llama import LlamaForCausalLM, RowParallelLinear
from engine.models.merged_linear import MergedLinear
from engine.models.moe import SparseMoeBlock
from engine.scheduling.request import Request


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    key: int  # this load's identity (never 0, the base model's)
    pinned: bool  # never evicted from its slot
    target_modules: tuple[str, ...] = ()  # the projections it changes: q_proj, ..., down_proj


def _write_now(work: Callable[[], None]) -> None:
    work()


class AdapterRegistry:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_rank: int,
        run_on_device: Callable[[Callable[[], None]], None] = _write_now,
        triton: bool = False,
    ) -> None:
        self.max_loras = max_loras
        self.triton = triton  # steps run the segmented Triton kernel (engine/lora/lora_kernel.py)
        self.max_rank = max_rank
        self.run_on_device = run_on_device
        self.loaded: dict[str, LoadedAdapter] = {}
        self.files: dict[int, AdapterFile] = {}  # each loaded key's weights, on the host
        self.slot_of_key: dict[int, int] = {}  # the resident ones
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident keys, least recent first
        self.evictions = 0
        self.weights: dict[nn.Module, ProjectionLora] = {}
        # Each target by its checkpoint module name -> (its projection's weights, part index).
        self.targets: dict[str, tuple[ProjectionLora, int]] = {}
        self.shapes: dict[str, tuple[int, int]] = {}  # the same names -> (out, in)
        self._keys = itertools.count(1)
        if max_loras:
            self._allocate(model)

    def _allocate(self, model: LlamaForCausalLM) -> None:
        param = model.model.embed_tokens.weight
        # An MoE block's projections (its shared expert's) take no adapter: not targets.
        moe = tuple(f"{p}." for p, m in model.named_modules() if isinstance(m, SparseMoeBlock))
        for prefix, module in model.named_modules():
            parent, _, own = prefix.rpartition(".")
            if moe and prefix.startswith(moe):
                continue
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

    @property
    def resident(self) -> list[str]:
        """The names of the adapters that hold a slot."""
        return [a.name for a in self.loaded.values() if a.key in self.slot_of_key]

    def load(
        self, name: str, path: str | Path, pinned: bool = False, busy: Collection[int] = ()
    ) -> LoadedAdapter:
        """Load the adapter at `path` as `name`, resident at once if a slot is free or can be
        freed (`busy`: the keys running requests use). ValueError (nothing changed) when the
        name is taken or empty, pinning it would pin every slot, or the adapter does not fit."""
        if not name:
            raise ValueError("adapter name: must not be empty (the base model's)")
        if name in self.loaded:
            raise ValueError(f"adapter {name!r}: already loaded")
        if not self.max_loras:
            raise ValueError("max_loras is 0: this engine serves no LoRA adapters")
        if pinned and sum(a.pinned for a in self.loaded.values()) + 1 >= self.max_loras:
            raise ValueError(
                f"adapter {name!r}: pinned, it would leave none of max_loras={self.max_loras} "
                "slots for the others"
            )
        file = read_adapter(path, self.shapes, self.max_rank)
        key = next(self._keys)
        targets = {module.rpartition(".")[2] for module in file.weights}
        modules = tuple(t for t in TARGETS if t in targets)
        loaded = LoadedAdapter(name, str(path), file.rank, file.scaling, key, pinned, modules)
        self.loaded[name] = loaded
        self.files[key] = file
        self.make_resident(key, busy)
        return loaded

    def unload(self, name: str) -> None:
        """Forget `name` (its slot, if it holds one, is cleared). ValueError when it is not
        loaded. The caller makes sure no request runs it."""
        loaded = self.loaded.pop(name, None)
        if loaded is None:
            raise ValueError(f"adapter {name!r}: not loaded")
        del self.files[loaded.key]
        if loaded.key in self.slot_of_key:
            self._clear(self._take_slot(loaded.key))

    def make_resident(self, key: int, busy: Collection[int]) -> bool:
        """Whether adapter `key` holds a slot, given one now if a slot is free or holds an
        adapter neither pinned nor in `busy` (the least recently used of those is evicted)."""
        if key in self.slot_of_key:
            return True
        taken = set(self.slot_of_key.values())
        slot = next((s for s in range(self.max_loras) if s not in taken), None)
        if slot is None:
            pinned = {a.key for a in self.loaded.values() if a.pinned}
            victim = next((k for k in self.lru if k not in busy and k not in pinned), None)
            if victim is None:
                return False
            slot = self._take_slot(victim)
            self.evictions += 1
        self._write(slot, self.files[key])
        self.slot_of_key[key] = slot
        self.lru[key] = None
        return True

    def _take_slot(self, key: int) -> int:
        del self.lru[key]
        return self.slot_of_key.pop(key)

    def _write(self, slot: int, file: AdapterFile) -> None:
        def write() -> None:
            with torch.no_grad():
                for lora in self.weights.values():
                    lora.clear(slot)
                for module, (a, b) in file.weights.items():
                    lora, part = self.targets[module]
                    lora.write(slot, part, a, b, file.scaling)

        self.run_on_device(write)

    def _clear(self, slot: int) -> None:
        def clear() -> None:
            with torch.no_grad():
                for lora in self.weights.values():
                    lora.clear(slot)

        self.run_on_device(clear)

    def key_of(self, name: str) -> int | None:
        """The key of the resident adapter `name`; 0 for "" (the base model); None if absent."""
        if not name:
            return 0
        loaded = self.loaded.get(name)
        return None if loaded is None else loaded.key

    def step(
        self, requests: Sequence[Request], query_lens: Sequence[int], device: torch.device
    ) -> LoraStep | None:
        """The LoRA pass of a step feeding `query_lens` tokens of each request (packed in
        order), or None when no request has an adapter. Every request's adapter is resident
        (the scheduler admitted it so, and running requests' adapters are not evicted)."""
        if not self.slot_of_key:
            return None
        slots = [self.slot_of_key[r.adapter_key] if r.adapter_key else -1 for r in requests]
        if max(slots) < 0:
            return None
        for key in {r.adapter_key for r in requests} - {0}:
            self.lru.move_to_end(key)
        token_slots = np.repeat(np.asarray(slots), np.asarray(query_lens))  # [tokens]
        groups = []
        for slot in sorted(set(slots) - {-1}):
            rows = torch.from_numpy(np.flatnonzero(token_slots == slot))
            groups.append((slot, rows.to(device, non_blocking=True)))
        return LoraStep(groups, self.weights, self.triton)
