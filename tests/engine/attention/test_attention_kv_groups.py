"""Attention through KV groups (torch_ref): a layer whose cache is a LayerCache of group g reads
and writes through group g's table and slots; a sliding layer's table entries outside its window
(given back pages: the scratch page) change nothing; a page-strided cache view (a smaller layer
sharing a storage slot with a larger one) computes as a dense one."""

from __future__ import annotations

import torch

from engine.attention.backend import LayerAttention
from engine.attention.metadata import AttentionMetadata, LayerCache
from engine.attention.torch_ref import TorchRefAttention
from tests.support.paged_steps import Step, reference

WINDOW = LayerAttention(sliding_window=7)
PAGE = 4


def _step() -> Step:
    # A prefill chunk after a cached prefix, and two decodes: contexts past the window.
    return Step([30, 23, 17], [5, 1, 1], page_size=PAGE, head_dim=8)


def _backend() -> TorchRefAttention:
    return TorchRefAttention(0.25, PAGE)


def test_a_layer_of_group_1_attends_through_group_1s_table_and_slots() -> None:
    step = _step()
    expected_out, expected_k, _ = step.run(_backend(), WINDOW)
    # Group 0's table is another one (its pages hold other layers' KV): the layer must not
    # read it. Group 1's is the step's own.
    assert step.meta.block_tables is not None and step.meta.slot_mapping is not None
    meta = AttentionMetadata(**{**step.meta.__dict__})
    meta.block_tables = torch.zeros_like(step.meta.block_tables)
    meta.slot_mapping = torch.zeros_like(step.meta.slot_mapping)
    meta.groups = [meta.with_tables(step.meta.slot_mapping, step.meta.block_tables)]
    backend = _backend()
    backend.prepare(meta)
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    cache = LayerCache(k_cache, v_cache, 1)
    out = backend.forward(step.q, step.k, step.v, step.positions, step.rotary, cache, meta, WINDOW)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(k_cache, expected_k)


def test_pages_outside_the_window_may_read_the_scratch_page() -> None:
    step = _step()
    expected = reference(step, *step.run(_backend(), WINDOW)[1:], WINDOW)
    # Every entry wholly below each sequence's first query's window reads a page of garbage.
    tables = step.meta.block_tables
    assert tables is not None
    scratch = step.k_cache.shape[0]
    k_cache = torch.cat([step.k_cache, torch.full_like(step.k_cache[:1], 1e4)])
    v_cache = torch.cat([step.v_cache, torch.full_like(step.v_cache[:1], -1e4)])
    lens = zip(step.meta.context_lens, step.meta.query_lens, strict=True)
    for seq, (ctx, q_len) in enumerate(lens):
        first = max(0, ctx - q_len - 7 + 1) // PAGE  # below the first query's window of 7
        tables[seq, :first] = scratch
    step.k_cache, step.v_cache = k_cache, v_cache
    out = step.run(_backend(), WINDOW)[0]
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=0)


def test_a_page_strided_cache_view_computes_as_a_dense_one() -> None:
    step = _step()
    expected_out, expected_k, expected_v = step.run(_backend(), WINDOW)
    pages, elems = step.k_cache.shape[0], step.k_cache[0].numel()
    storage = [torch.zeros(pages, 2 * elems) for _ in range(2)]  # rows of a larger layer
    k_view, v_view = (t[:, :elems].view(step.k_cache.shape) for t in storage)
    assert not k_view.is_contiguous()
    k_view.copy_(step.k_cache)
    v_view.copy_(step.v_cache)
    backend = _backend()
    meta = step.prepared(backend)
    out = backend.forward(
        step.q, step.k, step.v, step.positions, step.rotary, (k_view, v_view), meta, WINDOW
    )
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(k_view, expected_k)
    torch.testing.assert_close(v_view, expected_v)
    assert not storage[0][:, elems:].any()  # the larger layer's part of each page untouched
