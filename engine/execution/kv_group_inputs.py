"""The step inputs of a model whose layers form several KV groups (engine/kv_cache/kv_groups.py):
each layer's cache names its group (LayerCache), and groups 1.. get their own slot mappings
and block tables beside group 0's (StepInputs' `group_slots` and `group_tables`)."""

from __future__ import annotations

import numpy as np

from engine.attention.backend import KVCache
from engine.attention.metadata import LayerCache
from engine.execution.step_inputs import StepArrays
from engine.kv_cache.page_pool import PagePool


def group_caches(pool: PagePool) -> list[KVCache]:
    """Each model layer's K and V pages; a LayerCache naming its group when there are several."""
    caches = pool.layer_caches()
    if pool.groups.num_groups == 1:
        return caches
    placement = pool.groups.placement()
    return [LayerCache(k, v, group) for (k, v), (group, _) in zip(caches, placement, strict=True)]


def fill_groups(
    a: StepArrays,
    size: int,
    tables: list[np.ndarray],
    slots: np.ndarray,
    query_lens: list[int],
    width: int,
    graph_rows: int | None = None,
) -> None:
    """Groups 1..'s slot mappings and block tables (`tables`: the BlockTable's group_pages)
    for a step whose positions are filled: every token's slot through its group's page."""
    num_seqs, num_tokens = len(query_lens), sum(query_lens)
    if num_tokens == num_seqs:
        seq = np.arange(num_seqs)
    else:
        seq = np.repeat(np.arange(num_seqs), np.asarray(query_lens, dtype=np.int64))
    positions = a.positions[:num_tokens]
    rows, page, offset = slots[seq], positions // size, positions % size
    for group, pages in enumerate(tables, 1):
        a.group_slots[group - 1, :num_tokens] = pages[rows, page].astype(np.int64) * size + offset
        if graph_rows is None:
            view = a.group_table(group, num_seqs, width)
        else:
            view = a.group_table(group, graph_rows, width, page_major=True)[:num_seqs]
        view[...] = pages[slots, :width]
