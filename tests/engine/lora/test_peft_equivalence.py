"""Greedy ids and logprobs of requests with LoRA adapters equal peft's model on Hugging Face.

Three adapters made by peft (ranks 8, 4 with rsLoRA, 16; all seven projections, attention
and one MLP projection, the MLP and o_proj) and the base model, mixed in the same steps.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.lora_adapters import MLP, make_adapter, peft_greedy, peft_model
from tests.support.tiny_models import prompts

NEW_TOKENS = 20
SPECS: dict[str, dict[str, Any]] = {
    "a": {"r": 8, "alpha": 16},
    "b": {"r": 4, "alpha": 8, "use_rslora": True, "targets": ("q_proj", "v_proj", "down_proj")},
    "c": {"r": 16, "alpha": 32, "targets": (*MLP, "o_proj")},
}
CHOICES = ["", "a", "b", "c"]  # "" = the base model


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_llama, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, adapters: dict[str, Path]) -> Any:
    """(adapter name, prompt) -> peft's greedy ids and logprobs, each computed once."""
    models = {name: peft_model(tiny_llama, adapters.get(name)) for name in CHOICES}

    @functools.cache
    def greedy(name: str, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
        return peft_greedy(models[name], list(prompt), NEW_TOKENS)

    return greedy


def make_engine(checkpoint: Path, adapters: dict[str, Path], **overrides: Any) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint), device="cpu", dtype="float32", max_loras=4, max_lora_rank=16
    )
    engine = LLMEngine(dataclasses.replace(config, **overrides))
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def greedy(adapter: str) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, adapter=adapter
    )


def check(results: list[Any], cases: list[tuple[str, list[int]]], reference: Any) -> None:
    for (adapter, prompt), result in zip(cases, results, strict=True):
        expected, logprobs = reference(adapter, tuple(prompt))
        assert result.error is None
        assert result.token_ids == expected, f"adapter {adapter!r}, {len(prompt)} tokens"
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


def mixed_cases(vocab_size: int, count: int = 6) -> list[tuple[str, list[int]]]:
    """Every prompt once per adapter and once for the base model."""
    return [(adapter, p) for p in prompts(vocab_size, count) for adapter in CHOICES]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_batch_mixing_three_adapters_and_the_base_model_equals_peft(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any, overlap: bool
) -> None:
    engine = make_engine(tiny_llama, adapters, overlap_steps=overlap)
    cases = mixed_cases(engine.info.vocab_size)
    results = engine.generate([p for _, p in cases], [greedy(a) for a, _ in cases])
    check(results, cases, reference)
    assert engine.pool.num_free + engine.cache.num_cached == engine.pool.num_pages


def test_preempted_requests_with_adapters_resume_with_peft_tokens(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any
) -> None:
    engine = make_engine(tiny_llama, adapters, num_kv_pages=24, page_size=8)
    cases = mixed_cases(engine.info.vocab_size)
    results = engine.generate([p for _, p in cases], [greedy(a) for a, _ in cases])
    assert engine.scheduler.num_preemptions > 0
    check(results, cases, reference)


def test_a_cached_prefix_is_reused_only_under_the_same_adapter(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any
) -> None:
    engine = make_engine(tiny_llama, adapters, page_size=4)
    prompt = prompts(engine.info.vocab_size, 6)[5]  # 44 tokens: 11 full pages
    scheduler = engine.scheduler
    order = ["", "a", "b", "a", "", "c"]
    hits = []
    for adapter in order:
        before = scheduler.prefix_hits
        check(engine.generate([prompt], greedy(adapter)), [(adapter, prompt)], reference)
        hits.append(scheduler.prefix_hits - before)
    # Only a second request under the same adapter (or the base model) finds the prompt's KV.
    assert hits[:3] == [0, 0, 0] and hits[5] == 0
    assert hits[3] > 0 and hits[4] > 0


def test_n_samples_of_an_adapter_fork_from_its_own_prompt_kv(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any
) -> None:
    engine = make_engine(tiny_llama, adapters)
    batch = prompts(engine.info.vocab_size, 4)[1:]
    cases = [(adapter, p) for p, adapter in zip(batch, ["b", "", "c"], strict=True)]
    results = engine.generate([p for _, p in cases], [greedy(a) for a, _ in cases], n=3)
    check(results, [case for case in cases for _ in range(3)], reference)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_requests_beyond_max_loras_wait_for_a_slot_and_equal_peft(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any, overlap: bool
) -> None:
    engine = make_engine(tiny_llama, adapters, max_loras=1, overlap_steps=overlap)
    cases = mixed_cases(engine.info.vocab_size, count=3)
    results = engine.generate([p for _, p in cases], [greedy(a) for a, _ in cases])
    check(results, cases, reference)
    assert engine.lora.evictions >= len(SPECS)  # each adapter had its turn in the one slot
