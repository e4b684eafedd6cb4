"""EngineStats: what every engine message reports of the engine's requests, pages and counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    total_pages: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    policy_version: int = 0
    prompt_tokens_computed: int = 0  # cumulative prefill tokens run through the model
    tokens_generated: int = 0  # cumulative sampled tokens
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative prompt tokens found there
    preemptions: int = 0  # cumulative
    # Speculative decoding, cumulative: tokens proposed, and those of them accepted.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    updating_weights: bool = False  # a weight update is pending or being applied
    sleep_level: int = 0  # 0 awake; 1 or 2 asleep (see Sleep)
    # The LoRA adapters of the running and the waiting requests, by name, sorted (always empty
    # when LoRA is off): what a router reads to send an adapter's requests where it is loaded.
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()

    @property
    def prefix_hit_ratio(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
