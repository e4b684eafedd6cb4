"""The torch_ref paged attention equals plain attention computed per sequence in float64.

Decode rows are sorted by context length into groups, each padded only to its own longest
context; these batches are wide and spread enough to make several groups.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.backend import LayerAttention
from engine.attention.metadata import DecodeGroup
from engine.attention.torch_ref import GROUP_ROWS, TorchRefAttention
from tests.support.paged_steps import Step, hide_passed_pages, reference


def check(step: Step) -> list[DecodeGroup]:
    """Assert torch_ref equals the reference on this step; return the decode groups it used."""
    backend = TorchRefAttention(0.25, step.page_size)
    out, k_cache, v_cache = step.run(backend)
    torch.testing.assert_close(out, reference(step, k_cache, v_cache), rtol=1e-5, atol=1e-5)
    return step.prepared(backend).decode_groups


def test_decode_rows_of_mixed_lengths_run_in_length_groups() -> None:
    rng = random.Random(0)
    contexts = [rng.randint(1, 300) for _ in range(5 * GROUP_ROWS + 3)]
    groups = check(Step(contexts, [1] * len(contexts), page_size=16))
    assert len(groups) > 1
    assert sum(g.tables.shape[0] for g in groups) == len(contexts)
    widths = [g.tables.shape[1] for g in groups]
    assert widths == sorted(widths) and widths[-1] == -(-max(contexts) // 16)


def test_mixed_step_with_prefill_rows_between_decode_groups() -> None:
    rng = random.Random(1)
    contexts = [rng.randint(1, 200) for _ in range(3 * GROUP_ROWS)]
    queries = [1] * len(contexts)
    for i in (0, 7, 30):  # prefill chunks: a fresh prompt, and two over cached prefixes
        queries[i] = contexts[i] if i == 0 else min(contexts[i], 9)
    groups = check(Step(contexts, queries, page_size=4, seed=1))
    assert len(groups) > 1 and all(g.rows is not None for g in groups)


def test_decode_rows_of_equal_length_stay_one_call() -> None:
    groups = check(Step([40] * (4 * GROUP_ROWS), [1] * (4 * GROUP_ROWS), seed=2))
    assert len(groups) == 1 and groups[0].rows is None  # batch order: no scatter


def test_new_keys_land_rotated_in_their_slots_and_values_as_given() -> None:
    step = Step([5, 20], [5, 3], page_size=4, seed=3)
    _, k_cache, v_cache = step.run(TorchRefAttention(0.25, step.page_size))
    assert step.meta.slot_mapping is not None
    slots = step.meta.slot_mapping
    heads, dim = k_cache.shape[2:]
    rotated_k = step.rotated()[1]
    assert not torch.equal(rotated_k, step.k)  # positions past 0 rotate
    torch.testing.assert_close(k_cache.view(-1, heads, dim)[slots], rotated_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, heads, dim)[slots], step.v, rtol=0, atol=0)


class SdpaDecode(TorchRefAttention):
    """torch_ref with its bfloat16 CPU decode sent through SDPA, as float32's is."""

    def _decode_matmul(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return self._sdpa(q.unsqueeze(2), keys, values, mask).squeeze(2)


def test_bfloat16_decode_on_cpu_is_as_close_as_sdpa() -> None:
    """Decode in bfloat16 runs two GEMMs, not SDPA (much faster on the CPU): its error against
    the float64 reference is within bfloat16 bounds and near SDPA's own bfloat16 error."""
    rng = random.Random(4)
    contexts = [rng.randint(1, 300) for _ in range(3 * GROUP_ROWS)]
    step = Step(contexts, [1] * len(contexts), page_size=16, head_dim=64, seed=4)
    for name in ("k_cache", "v_cache", "q", "k", "v"):
        setattr(step, name, getattr(step, name).bfloat16())
    backend = TorchRefAttention(0.25, step.page_size)
    out, k_cache, v_cache = step.run(backend)
    expected = reference(step, k_cache, v_cache)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    sdpa_out = step.run(SdpaDecode(0.25, step.page_size))[0]
    assert not torch.equal(out, sdpa_out)  # the GEMM path ran
    ours, theirs = ((o.float() - expected).abs().mean() for o in (out, sdpa_out))
    assert ours < 1.5 * theirs, (ours, theirs)


# Layer kinds: a window shorter than most contexts, its own scale, a soft cap, learned sinks
# (gpt-oss's, Gemma 2's, Gemma 3's), alone and together.
LAYER_KINDS = [
    (LayerAttention(sliding_window=7), False),
    (LayerAttention(scale=0.11), False),
    (LayerAttention(softcap=1.5), False),
    (LayerAttention(), True),
    (LayerAttention(sliding_window=20, scale=0.3, softcap=2.0), True),
]


@pytest.mark.parametrize(("layer", "with_sinks"), LAYER_KINDS)
def test_layer_kinds_in_decode_and_mixed_steps(layer: LayerAttention, with_sinks: bool) -> None:
    rng = random.Random(3)
    contexts = [rng.randint(1, 90) for _ in range(2 * GROUP_ROWS)]
    queries = [1] * len(contexts)
    for i in (0, 5, 9):  # a fresh prompt and chunks over cached prefixes longer than a window
        queries[i] = contexts[i] if i == 0 else min(contexts[i], 13)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(4)) if with_sinks else None
    for step in (Step(contexts, queries, page_size=8, seed=3), Step(contexts, [1] * len(contexts))):
        out, k_cache, v_cache = step.run(TorchRefAttention(0.25, step.page_size), layer, sinks)
        expected = reference(step, k_cache, v_cache, layer, sinks)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("page_major", [False, True])
def test_a_window_reads_no_page_it_has_passed(with_sinks: bool, page_major: bool) -> None:
    """Decode rows gather only the pages their window can touch, prefill rows from their first
    query's first visible page: table entries of passed pages may point at a page of NaN.
    (SDPA for the window alone; the explicit float32 path with sinks.)"""
    layer = LayerAttention(sliding_window=20, scale=0.3)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(10)) if with_sinks else None
    rng = random.Random(10)
    contexts = [1, 19, 20, 21, 37, 100] + [rng.randint(1, 150) for _ in range(2 * GROUP_ROWS)]
    mixed = [1, 1, 1, 1, 30, 9] + [1] * (2 * GROUP_ROWS)  # chunks over prefixes > the window
    for queries, page_size in ((mixed, 8), ([1] * len(contexts), 4)):
        step = Step(contexts, queries, page_size=page_size, seed=10, page_major=page_major)
        _, k_cache, v_cache = step.run(TorchRefAttention(0.25, page_size), layer, sinks)
        expected = reference(step, k_cache, v_cache, layer, sinks)
        assert hide_passed_pages(step, 20) > 0
        out = step.run(TorchRefAttention(0.25, page_size), layer, sinks)[0]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
