"""The Triton paged-attention kernels equal torch_ref (and the float64 reference, for every layer
kind: windows, scales, soft caps, sinks): compiled on CUDA, else on the CPU through Triton's
interpreter, in float32 (the interpreter computes bfloat16 dots wrongly).

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine.attention.backend import FULL, LayerAttention
from engine.attention.torch_ref import TorchRefAttention
from tests.engine.attention.test_attention_torch_ref import LAYER_KINDS
from tests.support.paged_steps import DEVICE, Step, hide_passed_pages, reference
from tests.support.triton_interpreter import use_triton

use_triton(DEVICE)


@pytest.fixture(scope="module")
def triton_paged() -> ModuleType:
    import engine.attention.triton_paged as module

    return module


def assert_same_attention(
    step: Step, backend, layer: LayerAttention = FULL, sinks: torch.Tensor | None = None
) -> None:
    expected = step.run(TorchRefAttention(0.25, step.page_size), layer, sinks)
    got = step.run(backend, layer, sinks)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)  # the KV writes
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    exact = reference(step, got[1], got[2], layer, sinks)
    torch.testing.assert_close(got[0], exact.to(got[0].device), rtol=1e-5, atol=1e-5)


def forced_splits(backend, splits: int):
    """The backend with its decode split count forced (whatever the batch and layer)."""
    backend.num_splits = lambda *args: splits
    return backend


def sinks_of(with_sinks: bool, heads: int = 4) -> torch.Tensor | None:
    if not with_sinks:
        return None
    return torch.randn(heads, generator=torch.Generator().manual_seed(9)).to(DEVICE)


# A window wider than one 64-key block, so that several splits share it.
WIDE_WINDOW = (LayerAttention(sliding_window=100, softcap=3.0), True)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_equals_torch_ref_across_page_boundaries(
    triton_paged: ModuleType, page_size: int, splits: int
) -> None:
    # Contexts of one token, a page minus one, exactly a page, a page plus one, and several
    # pages (longer than one 64-token kernel block).
    step = Step([1, 15, 16, 17, 70], [1] * 5, page_size=page_size)
    backend = triton_paged.TritonPagedAttention(0.25, page_size, num_programs=0)
    assert_same_attention(step, forced_splits(backend, splits))


def test_decode_reads_a_page_major_block_table(triton_paged: ModuleType) -> None:
    step = Step([1, 15, 16, 17, 70], [1] * 5, page_size=4, page_major=True)
    assert step.meta.block_tables is not None and step.meta.block_tables.stride(0) == 1
    assert_same_attention(step, triton_paged.TritonPagedAttention(0.25, 4, num_programs=20))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 1), (6, 2)])
def test_decode_groups_query_heads_over_their_kv_head(
    triton_paged: ModuleType, heads: int, kv_heads: int
) -> None:
    step = Step([9, 33], [1, 1], heads=heads, kv_heads=kv_heads, head_dim=32, seed=1)
    assert_same_attention(step, triton_paged.TritonPagedAttention(0.25, 16))


def test_prefill_over_a_cached_prefix_equals_torch_ref(triton_paged: ModuleType) -> None:
    # A fresh prompt, a prompt over a 16-token cached prefix (a page), a chunk that starts
    # mid-page after 21 cached tokens, and a decode row in the same mixed step.
    step = Step([37, 16 + 40, 21 + 7, 12], [37, 40, 7, 1], page_size=16, seed=2)
    assert not step.meta.decode_only
    assert_same_attention(step, triton_paged.TritonPagedAttention(0.25, 16))


def test_prefill_with_wide_groups_and_many_query_blocks(triton_paged: ModuleType) -> None:
    # Group of 8: each program takes 8 query tokens, so 70 queries span 9 blocks.
    step = Step([70, 5], [70, 5], heads=8, kv_heads=1, page_size=4, seed=3)
    assert_same_attention(step, triton_paged.TritonPagedAttention(0.25, 4))


def test_decode_splits_follow_the_batch_size_only(triton_paged: ModuleType) -> None:
    backend = triton_paged.TritonPagedAttention(0.25, 16, num_programs=264)
    assert backend.num_splits(1, 8) == 16  # a lone sequence spreads over 16 splits (the cap)
    assert backend.num_splits(8, 8) == 8
    assert backend.num_splits(64, 8) == 1  # a full batch fills the device without splits
    assert backend.num_splits(1, 8, window_blocks=2) == 2  # a window of 65-128 keys: 2 blocks


# Every kind in one split; in four, the kinds whose range or denominator splits change.
DECODE_CASES = [(layer, sinks, 1) for layer, sinks in [*LAYER_KINDS, WIDE_WINDOW]] + [
    (layer, sinks, 4)
    for layer, sinks in [*LAYER_KINDS, WIDE_WINDOW]
    if sinks or layer.sliding_window is not None
]


@pytest.mark.parametrize(("layer", "with_sinks", "splits"), DECODE_CASES)
def test_decode_computes_every_layer_kind(
    triton_paged: ModuleType, layer: LayerAttention, with_sinks: bool, splits: int
) -> None:
    """Windows (shorter and longer than the contexts, starting mid-page), scales, caps and
    sinks, through one split and through split + reduce (sinks joined once)."""
    step = Step([1, 7, 21, 130, 200], [1] * 5, page_size=4, seed=4)
    backend = triton_paged.TritonPagedAttention(0.25, 4, num_programs=0)
    assert_same_attention(step, forced_splits(backend, splits), layer, sinks_of(with_sinks))


@pytest.mark.parametrize(("layer", "with_sinks"), [*LAYER_KINDS, WIDE_WINDOW])
def test_prefill_and_mixed_steps_compute_every_layer_kind(
    triton_paged: ModuleType, layer: LayerAttention, with_sinks: bool
) -> None:
    # A fresh prompt longer than the windows, chunks over cached prefixes longer than them
    # (one starting mid-page), and decode rows, in one mixed step.
    step = Step([40, 110 + 16, 30 + 9, 33], [40, 16, 9, 1], 8, heads=2, kv_heads=1, seed=5)
    assert not step.meta.decode_only
    backend = triton_paged.TritonPagedAttention(0.25, 8)
    assert_same_attention(step, backend, layer, sinks_of(with_sinks, heads=2))


@pytest.mark.parametrize("decode_only", [True, False])
def test_a_window_reads_no_page_it_has_passed(triton_paged: ModuleType, decode_only: bool) -> None:
    """Table entries of pages wholly before a block's window point at a page of NaN (the KV
    cache's scratch page): the kernels read neither them nor the page; page-major tables."""
    layer, sinks = LayerAttention(sliding_window=20, scale=0.3, softcap=2.0), sinks_of(True)
    contexts = [5, 37, 100, 64 + 20, 150]
    queries = [1] * 5 if decode_only else [5, 1, 30, 1, 9]
    step = Step(contexts, queries, page_size=4, seed=6, page_major=True)
    _, k_cache, v_cache = step.run(TorchRefAttention(0.25, 4), layer, sinks)
    expected = reference(step, k_cache, v_cache, layer, sinks)
    assert hide_passed_pages(step, 20) > 0
    backend = forced_splits(triton_paged.TritonPagedAttention(0.25, 4), 2)
    out = step.run(backend, layer, sinks)[0]
    torch.testing.assert_close(out, expected.to(out.device), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [256, 512])
def test_large_head_dims(triton_paged: ModuleType, head_dim: int) -> None:
    """Gemma 4's head sizes (256 sliding, 512 global): block sizes shrink with the head."""
    layer, sinks = LayerAttention(sliding_window=24, softcap=2.0), sinks_of(True, 2)
    decode_step = Step([3, 40], [1, 1], 8, 2, 1, head_dim, seed=7)
    for splits in (1, 2):
        backend = forced_splits(triton_paged.TritonPagedAttention(0.25, 8), splits)
        assert_same_attention(decode_step, backend, layer, sinks)
    mixed_step = Step([30 + 20, 9], [20, 1], 8, 2, 1, head_dim, seed=8)
    assert_same_attention(mixed_step, triton_paged.TritonPagedAttention(0.25, 8), layer, sinks)


def test_engine_greedy_tokens_equal_torch_ref(triton_paged: ModuleType, tiny_llama: Path) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[0, *range(5, 5 + n)] for n in (3, 18, 40)]

    def generate(backend: str) -> list[list[int]]:
        config = EngineConfig(
            model=str(tiny_llama),
            device=DEVICE,
            dtype="float32",
            attention_backend=backend,
            page_size=16,
            enforce_eager=True,
            warmup=False,  # a full step under the interpreter takes minutes
        )
        return [r.token_ids for r in LLMEngine(config).generate(prompts, params)]

    assert generate("triton") == generate("torch_ref")
