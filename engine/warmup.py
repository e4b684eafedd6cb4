"""warm_up: a full prefill step and a decode step of throwaway requests, run at start-up.

A new engine's first steps pay for what later steps reuse: the allocator grows its heap to the
largest step's activations, and kernels are chosen, packed or compiled for their shapes on
first use (oneDNN primitives, Triton's JIT, cuBLAS heuristics). On a CPU the heap's growth is
page faults, which a virtual machine whose host backs guest memory lazily makes up to 30x
dearer. Without a warm-up the first requests served pay all of it (docs/benchmarks.md has the
measurement); like vLLM's dummy run at start-up, `warm_up` pays it before the engine reports
ready.

The throwaway requests go through the real scheduler, model and sampler: up to max_num_seqs
greedy prompts that together fill one step's token budget (as far as the KV cache holds them),
two tokens each, so the second step decodes every row. Afterwards nothing of them is left:
their pages are free, the prefix cache is empty and the engine's counters read zero.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from engine.kv_cache.prefix_cache import PrefixCache
from engine.models.hf_config import ModelConfig
from engine.protocol.config import EngineConfig
from engine.protocol.messages import FinishReason, RequestOutput, SamplingParams
from engine.scheduling.scheduler import Scheduler

OUTPUT_TOKENS = 2  # one from the prefill step, one from a decode step of every row
PARAMS = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, seed=0)


class Engine(Protocol):
    """What warm_up uses of LLMEngine."""

    config: EngineConfig
    model_config: ModelConfig
    cache: PrefixCache
    scheduler: Scheduler
    prompt_tokens_computed: int
    tokens_generated: int

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None: ...

    def step(self) -> Sequence[RequestOutput]: ...

    def has_work(self) -> bool: ...


def warm_up(engine: Engine) -> dict[str, float]:
    """Run the throwaway requests to completion on an engine with nothing in flight, then
    reset what they touched. Returns how many prompts, their tokens and the seconds it took."""
    prompts = warmup_prompts(engine)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warmup-{i}", prompt, PARAMS)
    while engine.has_work():
        for out in engine.step():
            if out.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"the start-up warm-up failed: {out.error}")
    seconds = time.perf_counter() - start
    engine.cache.clear()
    scheduler = engine.scheduler
    scheduler.prefix_queries = scheduler.prefix_hits = scheduler.num_preemptions = 0
    engine.prompt_tokens_computed = engine.tokens_generated = 0
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "seconds": seconds}


def warmup_prompts(engine: Engine) -> list[list[int]]:
    """min(max_num_seqs, max_num_batched_tokens) equal prompts that fill the token budget,
    fewer where the KV cache or the context length cannot hold them all."""
    budget, pool = engine.config.max_num_batched_tokens, engine.cache.pool
    count = min(engine.config.max_num_seqs, budget)
    length = min(budget // count, engine.model_config.max_model_len - OUTPUT_TOKENS)
    if length < 1:
        return []
    count = min(count, pool.num_pages // pool.pages_for(length + OUTPUT_TOKENS))
    return [[0] * length for _ in range(count)]
