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
adapter of the same name), and a step looks up each key's slot. A `replace` (an adapter updated
in place under a new version: engine/lora/adapter_update.py) is a new load too, with a new key;
the old key is `retired`: its weights stay for the requests that still hold it until `sweep`
finds none does. Slot writes go through
the writer's `run_on_device`, ordered after the steps already launched (an overlapped step in
flight reads the slot's old weights, never half-written ones), and its `share_slot`, which
makes every other tensor-parallel rank write the same slot (engine/lora/adapter_slots.py:
each rank holds its slice).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from engine.lora.adapter_file import TARGETS, AdapterFile, read_adapter
from engine.lora.adapter_slots import AdapterSlots
from engine.lora.lora_weights import LoraStep
from engine.models.base import CausalLM
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
    version: int = 1  # its policy version: its first load's, raised by each replace


class SlotWriter(Protocol):
    """Where a slot's writes run: `run_on_device` orders a write after the steps already
    launched; `share_slot` tells the other tensor-parallel ranks to write the same adapter
    (None: clear) into the same slot (nothing with one rank)."""

    def run_on_device(self, work: Callable[[], None]) -> None: ...

    def share_slot(self, slot: int, file: AdapterFile | None) -> None: ...


class _WriteNow:
    def run_on_device(self, work: Callable[[], None]) -> None:
        work()

    def share_slot(self, slot: int, file: AdapterFile | None) -> None:
        pass


class AdapterRegistry:
    def __init__(
        self,
        model: CausalLM,
        max_loras: int,
        max_rank: int,
        writer: SlotWriter | None = None,
        triton: bool = False,
    ) -> None:
        self.max_loras = max_loras
        self.triton = triton  # steps run the segmented Triton kernel (engine/lora/lora_kernel.py)
        self.max_rank = max_rank
        self.writer = writer or _WriteNow()
        self.loaded: dict[str, LoadedAdapter] = {}
        self.files: dict[int, AdapterFile] = {}  # each loaded key's weights, on the host
        self.slot_of_key: dict[int, int] = {}  # the resident ones
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident keys, least recent first
        self.retired: set[int] = set()  # keys of replaced loads, kept while requests hold them
        self.evictions = 0
        self.slots = AdapterSlots(model, max_loras, max_rank)  # this rank's (rank 0's) weights
        self._keys = itertools.count(1)

    @property
    def resident(self) -> list[str]:
        """The names of the adapters that hold a slot."""
        return [a.name for a in self.loaded.values() if a.key in self.slot_of_key]

    def load(
        self,
        name: str,
        path: str | Path,
        pinned: bool = False,
        busy: Collection[int] = (),
        version: int = 1,
    ) -> LoadedAdapter:
        """Load the adapter at `path` as `name` at policy `version`, resident at once if a slot
        is free or can be freed (`busy`: the keys running requests use). ValueError (nothing
        changed) when the name is taken or empty, pinning it would pin every slot, or the
        adapter does not fit."""
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
        file = read_adapter(path, self.slots.shapes, self.max_rank)
        loaded = self._add(name, path, file, pinned, version)
        self.make_resident(loaded.key, busy)
        return loaded

    def replace(
        self, name: str, path: str | Path, version: int
    ) -> tuple[LoadedAdapter, LoadedAdapter]:
        """Load `path` as a new version of the loaded adapter `name` (it keeps its pinning)
        under a new key; the old key is retired (its weights and slot stay until `sweep` or
        `hand_over`). (old, new). ValueError, nothing changed, when `name` is not loaded or the
        new adapter does not fit; the version is the caller's to check."""
        old = self.loaded.get(name)
        if old is None:
            raise ValueError(f"adapter {name!r}: not loaded")
        file = read_adapter(path, self.slots.shapes, self.max_rank)
        self.retired.add(old.key)
        return old, self._add(name, path, file, old.pinned, version)

    def _add(
        self, name: str, path: str | Path, file: AdapterFile, pinned: bool, version: int
    ) -> LoadedAdapter:
        key = next(self._keys)
        targets = {module.rpartition(".")[2] for module in file.weights}
        modules = tuple(t for t in TARGETS if t in targets)
        loaded = LoadedAdapter(
            name, str(path), file.rank, file.scaling, key, pinned, modules, version
        )
        self.loaded[name] = loaded
        self.files[key] = file
        return loaded

    def hand_over(self, old: int, new: int) -> None:
        """The retired key `old`'s slot, if it holds one, now serves `new` (its weights written
        there, ordered after the steps launched): no request may hold `old` any more."""
        self.retired.discard(old)
        del self.files[old]
        if old not in self.slot_of_key:
            return
        slot = self._take_slot(old)
        self._write(slot, self.files[new])
        self.slot_of_key[new] = slot
        self.lru[new] = None

    def sweep(self, in_use: Collection[int]) -> None:
        """Forget the retired keys no request holds (`in_use`: those requests hold)."""
        for key in self.retired - set(in_use):
            self.retired.discard(key)
            del self.files[key]
            if key in self.slot_of_key:
                self._clear(self._take_slot(key))

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
        self.writer.run_on_device(lambda: self.slots.write(slot, file))
        self.writer.share_slot(slot, file)

    def _clear(self, slot: int) -> None:
        self.writer.run_on_device(lambda: self.slots.clear(slot))
        self.writer.share_slot(slot, None)

    def version_of(self, name: str) -> int | None:
        """The policy version of the adapter `name`; None if it is not loaded."""
        loaded = self.loaded.get(name)
        return None if loaded is None else loaded.version

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
        slots = self.request_slots(requests)
        if slots is None:
            return None
        for key in {r.adapter_key for r in requests} - {0}:
            self.lru.move_to_end(key)
        return self.slots.step(slots, query_lens, device, self.triton)

    def request_slots(self, requests: Sequence[Request]) -> np.ndarray | None:
        """Each request's adapter slot (-1: the base model); None when no request has one."""
        if not self.slot_of_key:
            return None
        slots = [self.slot_of_key[r.adapter_key] if r.adapter_key else -1 for r in requests]
        return np.asarray(slots, dtype=np.int64) if max(slots) >= 0 else None
