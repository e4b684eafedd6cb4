"""The start-up warm-up fills one step, leaves nothing behind and changes no output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.warmup import OUTPUT_TOKENS, warmup_prompts

PROMPTS = [[0, 5, 6, 7, 8, 9] * 6, [0, 11, 12], [0, 5, 6, 7, 8, 9] * 6 + [3]]  # a shared prefix


def engine(model: Path, warmup: bool, **settings: Any) -> LLMEngine:
    config = EngineConfig(
        model=str(model), device="cpu", dtype="float32", page_size=4, warmup=warmup, **settings
    )
    return LLMEngine(config)


def test_the_warm_up_fills_one_step_and_leaves_nothing_behind(tiny_llama: Path) -> None:
    warm = engine(tiny_llama, True, max_num_seqs=8, max_num_batched_tokens=96)
    assert warm.warmup is not None
    assert (warm.warmup["prompts"], warm.warmup["prompt_tokens"]) == (8, 96)
    stats = warm.stats()
    assert stats.free_pages == stats.total_pages and stats.cached_pages == 0
    assert (stats.running, stats.waiting) == (0, 0)
    counters = (stats.prompt_tokens_computed, stats.tokens_generated, stats.preemptions)
    assert counters == (0, 0, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert warm.requests == {}


def test_outputs_are_those_of_an_engine_without_it(tiny_llama: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)
    unseeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    results = []
    for warmup in (False, True):
        eng = engine(tiny_llama, warmup)
        assert (eng.warmup is not None) == warmup
        runs = [eng.generate(PROMPTS, p) for p in (greedy, seeded, unseeded)]
        cached = eng.stats().prefix_cache_hits  # the third prompt shares the first's pages
        results.append(([[(r.token_ids, r.logprobs) for r in run] for run in runs], cached))
    assert results[1] == results[0]
    assert results[0][1] > 0


def test_the_prompts_fit_the_kv_cache_and_the_context(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, False, max_num_seqs=64, max_num_batched_tokens=2048, num_kv_pages=40)
    prompts = warmup_prompts(eng.config, eng.model_config, eng.pool)
    assert {len(p) for p in prompts} == {2048 // 64}
    assert len(prompts) == 40 // eng.pool.pages_for(2048 // 64 + OUTPUT_TOKENS)
    short = engine(tiny_llama, False, max_num_seqs=1, max_model_len=20)
    assert [len(p) for p in warmup_prompts(short.config, short.model_config, short.pool)] == [
        20 - OUTPUT_TOKENS
    ]
    # And a warm-up on that small cache runs: what does not fit is not asked for.
    small = engine(tiny_llama, True, max_num_seqs=64, num_kv_pages=40)
    assert small.warmup is not None and small.warmup["prompts"] == len(prompts)
