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
from collections.abc import Callable, Sequence

from engine.kv_cache.page_pool import PagePool
from engine.models.hf_config import ModelConfig
from engine.protocol.config import EngineConfig
from engine.protocol.messages import FinishReason, RequestOutput, SamplingParams

AddRequest = Callable[[str, Sequence[int], SamplingParams], None]

OUTPUT_TOKENS = 2  # one from the prefill step, one from a decode step of every row
PARAMS = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, seed=0)


def warm_up(
    add_request: AddRequest,
    step: Callable[[], Sequence[RequestOutput]],
    has_work: Callable[[], bool],
    prompts: list[list[int]],
) -> dict[str, float]:
    """Run the throwaway `prompts` to completion on an engine with nothing in flight (the
    caller then resets what they touched: the prefix cache, the counters). Returns how many
    prompts, their tokens and the seconds it took."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        add_request(f"warmup-{i}", prompt, PARAMS)
    while has_work():
        for out in step():
            if out.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"the start-up warm-up failed: {out.error}")
    seconds = time.perf_counter() - start
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "seconds": seconds}


def warmup_prompts(
    config: EngineConfig, model_config: ModelConfig, pool: PagePool
) -> list[list[int]]:
    """min(max_num_seqs, max_num_batched_tokens) equal prompts that fill the token budget,
    fewer where the KV cache or the context length cannot hold them all."""
    budget = config.max_num_batched_tokens
    count = min(config.max_num_seqs, budget)
    length = min(budget // count, model_config.max_model_len - OUTPUT_TOKENS)
    if length < 1:
        return []
    count = min(count, pool.logical_capacity // pool.pages_for(length + OUTPUT_TOKENS))
    return [[0] * length for _ in range(count)]
