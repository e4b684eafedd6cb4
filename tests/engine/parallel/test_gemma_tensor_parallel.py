"""Gemma 2 and Gemma 3 at 2 tensor-parallel ranks (gloo, CPU): greedy ids equal one rank's and
transformers', logprobs within 1e-4, on prompts longer than the sliding window; each rank holds
half the heads (its KV layout says so, windows included) and half of the vocabulary."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


def make_engine(model: Path, ranks: int) -> LLMEngine:
    # One torch thread per rank: two ranks of two threads on two cores run 10-100x slower.
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        page_size=4,
        tensor_parallel_size=ranks,
    )
    return LLMEngine(config)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test makes; their workers are stopped after it."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_two_ranks_give_one_ranks_and_hf_greedy_ids(arch, tmp_path, engines) -> None:
    checkpoint = make_checkpoint(tmp_path / arch, arch)
    one = make_engine(checkpoint, 1)
    engines.append(two := make_engine(checkpoint, 2))
    layout = two.model.kv_layout
    assert layout.num_kv_heads == 1 and layout.layer(0).sliding_window == 8
    batch = prompts(one.info.vocab_size, count=4)[1:]  # 12..28 tokens: past the window of 8
    single, split = one.generate(batch, GREEDY), two.generate(batch, GREEDY)
    hf = load_hf_model(checkpoint)
    for prompt, a, b in zip(batch, single, split, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert b.token_ids == a.token_ids == expected
        chosen = hf_logprobs.gather(-1, torch.tensor(b.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(b.logprobs), chosen, atol=1e-4, rtol=0)
