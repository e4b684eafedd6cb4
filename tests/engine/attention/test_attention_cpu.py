"""The cpu backend (decode attention in engine/attention/cpu_attention.c, reading pages in place)
equals plain attention computed per sequence in float64, and `auto` picks it on the CPU.

The kernel must build here: the CI machines have a C compiler, and a test that quietly fell
back to torch_ref would check nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import cpu_kernels, make_backend, resolve_backend
from engine.attention.backend import LayerAttention
from engine.attention.cpu_paged import CpuPagedAttention
from engine.attention.torch_ref import TorchRefAttention
from engine.layers import native
from engine.layers.rope import RotaryEmbedding
from tests.engine.attention.test_attention_torch_ref import LAYER_KINDS
from tests.support.paged_steps import Step, hide_passed_pages, reference

CPU = torch.device("cpu")


def backend(page_size: int) -> CpuPagedAttention:
    lib = cpu_kernels.load()
    assert lib is not None, "the CPU decode kernel did not build (is a C compiler installed?)"
    return CpuPagedAttention(0.25, page_size, lib)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 16), (12, 4, 64), (4, 4, 32), (8, 1, 128), (2, 1, 512)],
)
def test_decode_rows_of_mixed_lengths_equal_the_reference(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    rng = random.Random(heads * kv_heads)
    contexts = [1, 2, 16, 17] + [rng.randint(1, 300) for _ in range(20)]
    step = Step(contexts, [1] * len(contexts), 16, heads, kv_heads, head_dim, seed=heads)
    out, k_cache, v_cache = step.run(backend(16))
    torch.testing.assert_close(out, reference(step, k_cache, v_cache), rtol=1e-5, atol=1e-5)
    groups = step.prepared(backend(16)).decode_groups
    assert len(groups) == 1 and groups[0].rows is None  # one call, batch order, no mask
    assert groups[0].mask is None


def test_mixed_step_decode_rows_between_prefill_rows() -> None:
    rng = random.Random(1)
    contexts = [rng.randint(1, 200) for _ in range(24)]
    queries = [1] * len(contexts)
    for i in (0, 7, 20):  # prefill chunks: a fresh prompt, and two over cached prefixes
        queries[i] = contexts[i] if i == 0 else min(contexts[i], 9)
    step = Step(contexts, queries, page_size=4, seed=1)
    out, k_cache, v_cache = step.run(backend(4))
    torch.testing.assert_close(out, reference(step, k_cache, v_cache), rtol=1e-5, atol=1e-5)


def test_page_major_block_tables() -> None:
    step = Step([30, 5, 64], [1, 1, 1], page_size=8, seed=2, page_major=True)
    out, k_cache, v_cache = step.run(backend(8))
    torch.testing.assert_close(out, reference(step, k_cache, v_cache), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 2, 64), (8, 8, 128), (4, 1, 48), (2, 1, 512)]
)
def test_bfloat16_decode_is_as_close_as_sdpa(heads: int, kv_heads: int, head_dim: int) -> None:
    """In bfloat16 the kernel scores and sums in float32 and rounds once, at the output: its
    error against the float64 reference is no worse than torch_ref's SDPA path's. (On a CPU
    with AVX512-BF16 head sizes that are multiples of 32 take its dot-product path; 48 the
    generic loop.)"""
    rng = random.Random(4)
    contexts = [rng.randint(1, 300) for _ in range(32)]
    step = Step(contexts, [1] * len(contexts), 16, heads, kv_heads, head_dim, seed=4)
    for name in ("k_cache", "v_cache", "q", "k", "v"):
        setattr(step, name, getattr(step, name).bfloat16())
    out, k_cache, v_cache = step.run(backend(16))
    expected = reference(step, k_cache, v_cache)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    ref_out = step.run(TorchRefAttention(0.25, step.page_size))[0]
    ours, theirs = ((o.float() - expected).abs().mean() for o in (out, ref_out))
    assert ours <= 1.05 * theirs, (ours, theirs)


def test_auto_picks_cpu_for_float32_and_bfloat16_on_the_cpu() -> None:
    assert resolve_backend("auto", CPU, torch.float32) == "cpu"
    assert resolve_backend("auto", CPU, torch.bfloat16) == "cpu"
    assert resolve_backend("auto", CPU, torch.float16) == "torch_ref"
    assert make_backend("auto", CPU, 0.25, 16, torch.float32).name == "cpu"
    with pytest.raises(ValueError, match="attention_backend: cpu runs float32 and bfloat16"):
        make_backend("cpu", CPU, 0.25, 16, torch.float16)


def test_without_a_compiler_auto_keeps_torch_ref(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SLUICE_KERNEL_CACHE", str(tmp_path))
    native.load.cache_clear()
    try:
        assert resolve_backend("auto", CPU, torch.float32) == "torch_ref"
        with pytest.raises(ValueError, match="attention_backend: cpu needs a C compiler"):
            resolve_backend("cpu", CPU, torch.float32)
    finally:
        native.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_values_land_in_the_cache_as_torch_ref_writes_them(dtype: torch.dtype) -> None:
    """The rotary embedding and the KV write are one C call: the cache afterwards equals
    torch_ref's (bfloat16 to the bit; float32 to rounding, the kernel may fuse a multiply-add)."""
    step = Step([5, 20, 33], [5, 3, 1], page_size=4, heads=8, kv_heads=2, head_dim=32, seed=5)
    for name in ("k_cache", "v_cache", "q", "k", "v"):
        setattr(step, name, getattr(step, name).to(dtype))
    _, k_cache, v_cache = step.run(backend(4))
    _, want_k, want_v = step.run(TorchRefAttention(0.25, 4))
    assert torch.equal(v_cache, want_v)
    if dtype == torch.bfloat16:
        assert torch.equal(k_cache, want_k)
    else:
        torch.testing.assert_close(k_cache, want_k, rtol=1e-6, atol=1e-6)
    assert not torch.equal(k_cache, step.k_cache)  # written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_partial_rotary_rotates_the_leading_dimensions_as_torch_ref(dtype: torch.dtype) -> None:
    """Phi-4-mini rotates 0.75 of each head: the C call's k cache and output equal torch_ref's
    with the same narrower tables (the rotated keys in bfloat16 to the bit)."""
    step = Step([5, 20, 33], [5, 3, 1], page_size=4, heads=8, kv_heads=2, head_dim=32, seed=6)
    step.rotary = RotaryEmbedding(32, 33, 10000.0, None, rotary_dim=24)
    for name in ("k_cache", "v_cache", "q", "k", "v"):
        setattr(step, name, getattr(step, name).to(dtype))
    out, k_cache, v_cache = step.run(backend(4))
    want_out, want_k, want_v = step.run(TorchRefAttention(0.25, 4))
    if dtype == torch.bfloat16:  # the rotation to the bit (attention rounds as SDPA does not)
        assert torch.equal(k_cache, want_k)
    else:
        torch.testing.assert_close(k_cache, want_k, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize(("layer", "with_sinks"), LAYER_KINDS)
def test_layer_kinds_equal_the_reference(layer: LayerAttention, with_sinks: bool) -> None:
    rng = random.Random(5)
    contexts = [rng.randint(1, 90) for _ in range(12)]
    queries = [1] * len(contexts)
    queries[3] = min(contexts[3], 11)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)) if with_sinks else None
    for step in (Step(contexts, queries, page_size=8, seed=5), Step(contexts, [1] * len(contexts))):
        out, k_cache, v_cache = step.run(backend(step.page_size), layer, sinks)
        expected = reference(step, k_cache, v_cache, layer, sinks)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [4, 16])
def test_windowed_decode_reads_no_page_the_window_has_passed(page_size: int) -> None:
    """Decode rows of a sliding layer run in the kernel, from max(0, len - window): a page
    wholly before the window may be any page (the KV cache points it at a scratch page)."""
    layer = LayerAttention(sliding_window=20, scale=0.3, softcap=2.0)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(7))
    contexts = [1, 19, 20, 21, 37, 100, 64 + 20]  # shorter, equal, longer; mid-page starts
    step = Step(contexts, [1] * len(contexts), page_size=page_size, seed=7)
    _, k_cache, v_cache = step.run(TorchRefAttention(0.25, page_size), layer, sinks)
    expected = reference(step, k_cache, v_cache, layer, sinks)
    assert hide_passed_pages(step, 20) > 0
    out = step.run(backend(page_size), layer, sinks)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("layer", "with_sinks"), LAYER_KINDS)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_bfloat16_layer_kinds_are_as_close_as_torch_ref(
    layer: LayerAttention, with_sinks: bool, head_dim: int
) -> None:
    """bfloat16 decode rows of every layer kind (head_dim 64: the AVX512-BF16 path where the CPU
    has it; 48: the generic loop) err no more than torch_ref's float32 scores rounded once."""
    rng = random.Random(8)
    contexts = [rng.randint(1, 120) for _ in range(16)]
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(8)) if with_sinks else None
    step = Step(contexts, [1] * len(contexts), 16, 4, 2, head_dim, seed=8)
    for name in ("k_cache", "v_cache", "q", "k", "v"):
        setattr(step, name, getattr(step, name).bfloat16())
    out, k_cache, v_cache = step.run(backend(16), layer, sinks)
    expected = reference(step, k_cache, v_cache, layer, sinks)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    ref_out = step.run(TorchRefAttention(0.25, 16), layer, sinks)[0]
    ours, theirs = ((o.float() - expected).abs().mean() for o in (out, ref_out))
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_windowed_prefill_chunks_read_no_page_the_window_has_passed() -> None:
    """Prefill rows (torch_ref's path) gather a sliding layer's keys from the page holding their
    first query's first visible key: chunks over cached prefixes longer than the window, beside
    decode rows, with the passed pages' table entries on a page of NaN."""
    layer = LayerAttention(sliding_window=20, softcap=2.0)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9))
    step = Step([30, 100 + 9, 64 + 30, 50], [30, 9, 30, 1], page_size=8, seed=9)
    _, k_cache, v_cache = step.run(TorchRefAttention(0.25, 8), layer, sinks)
    expected = reference(step, k_cache, v_cache, layer, sinks)
    assert hide_passed_pages(step, 20) > 0
    out = step.run(backend(8), layer, sinks)[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
