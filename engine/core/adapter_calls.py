"""LLMEngine's calls on its LoRA adapters (engine/lora/registry.py): load, replace in place under
a new version (engine/lora/adapter_update.py), unload, list; and the scheduler's gate that gives
a waiting request's adapter a slot.
"""

from __future__ import annotations

import threading
from pathlib import Path

from engine.core.request_table import RequestTable
from engine.core.step_loop import StepLoop
from engine.lora.adapter_update import replace_adapter
from engine.lora.registry import AdapterRegistry, LoadedAdapter
from engine.protocol.messages import InflightPolicy
from engine.scheduling.request import Request
from engine.scheduling.scheduler import AdapterGate, Scheduler


def adapter_gate(lora: AdapterRegistry) -> AdapterGate:
    """The scheduler's gate: a waiting request's adapter holds a slot, or is given one that no
    running request's adapter holds."""

    def resident(key: int, running: list[Request]) -> bool:
        return lora.make_resident(key, {r.adapter_key for r in running})

    return resident


class AdapterCalls:
    """A part of LLMEngine (engine/core/llm_engine.py), which sets these attributes."""

    lock: threading.RLock
    loop: StepLoop
    table: RequestTable
    lora: AdapterRegistry
    scheduler: Scheduler

    def load_adapter(
        self, name: str, path: str | Path, pinned: bool = False, version: int = 1
    ) -> LoadedAdapter:
        """Load the PEFT adapter directory `path` as `name` at policy `version` for requests that
        name it (resident now or when a slot frees; a pinned one keeps its slot). ValueError,
        nothing changed, when it does not fit (shapes, target modules, rank, pinning)."""
        with self.lock:
            return self.lora.load(name, path, pinned, self._adapters_running(), version)

    def replace_adapter(
        self,
        name: str,
        path: str | Path,
        policy_version: int = 0,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
    ) -> LoadedAdapter:
        """Update the loaded adapter `name` in place (engine/lora/adapter_update.py)."""
        with self.lock:
            self.loop.settle()  # NOTE: a launched step's tokens must report the version it ran
            seqs = [s for seqs in self.table.requests.values() for s in seqs]
            return replace_adapter(
                self.lora,
                self.scheduler,
                self.table.abort,
                seqs,
                name,
                path,
                policy_version,
                inflight,
            )

    def unload_adapter(self, name: str) -> None:
        """ValueError when `name` is not loaded or a request in flight runs it."""
        with self.lock:
            key = self.lora.key_of(name)
            users = [
                i for i, seqs in self.table.requests.items() if key and seqs[0].adapter_key == key
            ]
            if users:
                raise ValueError(f"adapter {name!r}: {len(users)} requests in flight run it")
            self.lora.unload(name)

    def adapters(self) -> list[LoadedAdapter]:
        with self.lock:
            return list(self.lora.loaded.values())

    def _adapters_running(self) -> set[int]:
        return {r.adapter_key for r in self.scheduler.running}
