"""KVGroups: a model's layers grouped by the window they attend over, each group paged on its own.

Layers that attend over their whole context (full attention) need every page of a request;
a layer with a sliding window of W tokens needs only the pages its future queries can still
see. Layers are grouped by window, and every group has its own page list per request (logical
page k covers tokens [k * page_size, (k + 1) * page_size), as in every group) and its own
block-table rows, so a sliding group can give pages back while the request runs.

All groups draw page ids from one pool (one free list). The pool keeps `slots` storage tensors
(K and V each); the j-th layer of every group lives in storage j, so a page id held by one group
costs exactly that group's layers' memory. So that no page id pays for layers it does not use,
a window class of many layers is split into groups of `slots` layers, the size of the smallest
class (vLLM's hybrid KV cache manager does the same): gpt-oss (12 sliding, 12 full) is two
groups of 12; a 5:1 Gemma 3 of 30 layers is one full group and five sliding groups of 5.

Group 0 is a full-attention group when the model has one: its pages are the ones the prefix
cache reports in its KV events and the ones a request's `pages` list holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class LayerShape(Protocol):
    """What grouping needs of a layer (engine/models/base.py's LayerKV)."""

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def sliding_window(self) -> int | None: ...


@dataclass(frozen=True)
class KVGroups:
    """Per group: its window (None: full attention) and its model layers, in layer order;
    per layer: its (kv_heads, head_dim). Built by `group_layers`."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, int], ...]  # per model layer

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def slots(self) -> int:
        """Storage tensors (K and V each): the size of the largest group."""
        return max(len(layers) for layers in self.layers)

    @property
    def sliding(self) -> tuple[int, ...]:
        """The groups whose pages are reclaimed as their window moves on."""
        return tuple(g for g, w in enumerate(self.windows) if w is not None)

    @property
    def simple(self) -> bool:
        """One full-attention group whose layers share one page shape: the pool of old, one
        [layers, pages, ...] tensor each for K and V."""
        return self.windows == (None,) and len(set(self.shapes)) == 1

    def placement(self) -> list[tuple[int, int]]:
        """Per model layer: (its group, its storage slot)."""
        where = [(0, 0)] * len(self.shapes)
        for g, layers in enumerate(self.layers):
            for j, layer in enumerate(layers):
                where[layer] = (g, j)
        return where

    def slot_elements(self, page_size: int) -> list[int]:
        """Per storage slot: the elements of one page there, the largest layer's that uses it."""
        sizes = [0] * self.slots
        for layers in self.layers:
            for j, layer in enumerate(layers):
                heads, dim = self.shapes[layer]
                sizes[j] = max(sizes[j], page_size * heads * dim)
        return sizes


def uniform(num_layers: int, kv_heads: int, head_dim: int) -> KVGroups:
    """Every layer full attention, one shape: one group (every Llama, Qwen and MoE model)."""
    return KVGroups((None,), (tuple(range(num_layers)),), ((kv_heads, head_dim),) * num_layers)


def group_layers(layers: Sequence[LayerShape]) -> KVGroups:
    """Group a model's layers: full attention first, then windows from the smallest; each
    window class split into chunks of the smallest class's size, in layer order."""
    classes: dict[int | None, list[int]] = {}
    for i, layer in enumerate(layers):
        classes.setdefault(layer.sliding_window, []).append(i)
    size = min(len(members) for members in classes.values())
    order = sorted(classes, key=lambda w: -1 if w is None else w)
    windows: list[int | None] = []
    groups: list[tuple[int, ...]] = []
    for window in order:
        members = classes[window]
        for start in range(0, len(members), size):
            windows.append(window)
            groups.append(tuple(members[start : start + size]))
    shapes = tuple((layer.num_kv_heads, layer.head_dim) for layer in layers)
    return KVGroups(tuple(windows), tuple(groups), shapes)


def first_needed_page(window: int, num_computed: int, page_size: int) -> int:
    """The lowest logical page a sliding group must still hold once `num_computed` tokens are
    in the cache: the next query (position num_computed) sees keys j > num_computed - window,
    and every later query sees less far back. Pages below are outside every future window."""
    return max(0, num_computed - window + 1) // page_size
