"""The Triton paged-attention kernels equal torch_ref: compiled on CUDA, else on the CPU
through Triton's interpreter.

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine.attention.torch_ref import TorchRefAttention
from tests.support.paged_steps import DEVICE, Step
from tests.support.triton_interpreter import use_triton

use_triton(DEVICE)


@pytest.fixture(scope="module")
def triton_paged() -> ModuleType:
    import engine.attention.triton_paged as module

    return module


def assert_same_attention(step: Step, backend) -> None:
    expected = step.run(TorchRefAttention(0.25, step.page_size))
    got = step.run(backend)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)  # the KV writes
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_equals_torch_ref_across_page_boundaries(
    triton_paged: ModuleType, page_size: int, splits: int
) -> None:
    # Contexts of one token, a page minus one, exactly a page, a page plus one, and several
    # pages (longer than one 64-token kernel block).
    step = Step([1, 15, 16, 17, 70], [1] * 5, page_size=page_size)
    backend = triton_paged.TritonPagedAttention(0.25, page_size, num_programs=0)
    backend.num_splits = lambda num_seqs, kv_heads: splits
    assert_same_attention(step, backend)


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
