"""ModelMemory: the KV pool's and the weights' storage, released for a sleep and reallocated.

Storage is resized in place (`untyped_storage().resize_(0)`, as FSDP frees parameters), so
every tensor object and view (the runner's per-layer KV views, the checkpoint-name views of
merged projections) stays the same object and sees the new storage once it is restored; only
the addresses change. A restored storage holds garbage until it is filled: the KV pool is
zeroed; the weights are `weights_stale` until the caller has loaded every tensor
(`mark_filled`). NOTE: while released, views cannot even be made of a parameter (the
checkpoint-name views of merged projections included): restore first.

CUDA graphs capture addresses: they are dropped on release and captured again once both the
weights and the KV pool are back. Freed memory goes back to the system: on CUDA torch's caching
allocator keeps freed blocks until `torch.cuda.empty_cache()`; on the CPU every storage here
was allocated inside `mapped_allocations` (at load, and again here on restore), so each buffer
of a MiB or more is a mapping of its own that free() unmaps at once, and glibc's malloc_trim
returns what smaller chunks leave in its heaps. The packed copies of the weights are made
again, mapped, once a Wake has reloaded the weights (`prepack_weights`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterable

import torch

from engine.execution.host_malloc import mapped_allocations
from engine.execution.model_runner import ModelRunner
from engine.kv_cache.page_pool import PagePool
from engine.layers.linear import prepack
from engine.models.base import CausalLM
from engine.moe.experts import StackedExperts

Released = list[tuple[torch.UntypedStorage, int]]  # each storage, with its size before


class ModelMemory:
    def __init__(self, model: CausalLM, pool: PagePool, runner: ModelRunner | None) -> None:
        """`runner`: the one whose CUDA graphs read this memory (None: no graphs, the
        speculative draft model's)."""
        self.model = model
        self.pool = pool
        self.runner = runner
        self.device = pool.device
        self._kv: Released = []
        self._weights: Released = []
        self.weights_stale = False  # storage back, contents not loaded yet

    @property
    def kv_released(self) -> bool:
        return bool(self._kv)

    @property
    def weights_released(self) -> bool:
        return bool(self._weights)

    def release_kv(self) -> int:
        """Free the K and V pages (every page must be free: nothing may reference them).
        Returns the bytes freed."""
        assert not self.kv_released, "the KV pool is already released"
        assert self.pool.num_free == self.pool.num_pages, "KV pages are still referenced"
        self._drop_graphs()  # NOTE: before the storage goes: graphs point into it
        self._kv = _release(self.pool.storage)
        _return_to_system(self.device)
        return sum(nbytes for _, nbytes in self._kv)

    def restore_kv(self) -> None:
        """Reallocate the K and V pages (same count, zeroed), then capture the CUDA graphs
        again; the weights must be in place (they are captured with them)."""
        assert self.kv_released and not self.weights_released and not self.weights_stale
        with mapped_allocations(self.device.type):
            _restore(self._kv)
        self._kv = []
        for tensor in self.pool.storage:
            tensor.zero_()
        if self.runner is not None and self.runner.graphs is not None:
            self.runner.graphs.capture()

    def release_weights(self) -> int:
        """Free every parameter's storage (stale or not), and the CPU's packed copies of the
        weights (engine/layers/linear.py). Returns the bytes freed."""
        assert not self.weights_released, "the weights are already released"
        self.weights_stale = False
        self._drop_graphs()
        params = list(self.model.parameters())
        for param in params:
            if hasattr(param, "_cpu_copy"):
                del param._cpu_copy
        for module in self.model.modules():
            if isinstance(module, StackedExperts):
                module.drop_views()  # with the packed copies cached on them
        self._weights = _release(params)
        _return_to_system(self.device)
        return sum(nbytes for _, nbytes in self._weights)

    def restore_weights(self) -> None:
        """Reallocate every parameter's storage: stale until `mark_filled` (the caller fills
        every tensor before anything runs on them)."""
        assert self.weights_released
        with mapped_allocations(self.device.type):
            _restore(self._weights)
        self._weights = []
        self.weights_stale = True

    def mark_filled(self) -> None:
        """Every tensor of the restored weights has been loaded."""
        self.weights_stale = False

    def prepack_weights(self) -> None:
        """Make the weights' packed copies now (as at load), mapped like the weights, rather
        than from the heap by the first steps after a Wake."""
        with mapped_allocations(self.device.type):
            for weight in self.model.linear_weights():
                prepack(weight)

    @property
    def weights_missing(self) -> bool:
        """The weights cannot serve: released, or restored but not loaded yet."""
        return self.weights_released or self.weights_stale

    def _drop_graphs(self) -> None:
        graphs = self.runner.graphs if self.runner is not None else None
        if graphs is not None:
            graphs.graphs.clear()
            graphs.outputs.clear()


def _release(tensors: Iterable[torch.Tensor]) -> Released:
    """Resize each distinct storage under `tensors` to 0 bytes; returns them and their sizes."""
    released: Released = []
    seen: set[int] = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        released.append((storage, storage.nbytes()))
    for storage, _ in released:
        storage.resize_(0)
    return released


def _restore(released: Released) -> None:
    for storage, nbytes in released:
        storage.resize_(nbytes)


def _return_to_system(device: torch.device) -> None:
    """Hand freed memory back: the CUDA allocator's cached blocks, or glibc's free chunks."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    elif sys.platform.startswith("linux"):
        _malloc_trim()


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only (not musl)
    if trim is not None:
        trim(0)
