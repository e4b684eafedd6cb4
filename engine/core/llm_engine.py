"""LLMEngine: the in-process API over the model, KV cache, scheduler and sampler.

Usable directly by a trainer in the same process (`generate`), and by the engine process's
pipe loop (`add_request` / `abort` / `step`). A facade: the RequestTable (engine/core/
request_table.py) owns the requests and every way one starts or ends outside a step; the
StepLoop (engine/core/step_loop.py) owns the step: schedule, run, postprocess, with
`overlap_steps` the run of one step overlapping the host work of the next. Every request ends
with exactly one output whose `finish_reason` is set. Weight updates are WeightUpdater's
(engine/weights/weight_updater.py), sleep and wake Sleeper's (engine/sleep/sleeper.py), and the
calls that wait for them are in engine/core/in_process.py; `generate` is engine/core/generate.py.
`close()` stops the tensor-parallel workers (engine/core/model_parts.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

from engine.core.adapter_calls import AdapterCalls, adapter_gate
from engine.core.generate import generate
from engine.core.model_parts import grammars, load_model_parts
from engine.core.postprocess import Postprocessor
from engine.core.request_table import RequestTable
from engine.core.step_loop import StepLoop, overlap_enabled
from engine.core.warmup import warm_up, warmup_prompts
from engine.core.weight_calls import WeightAndSleepCalls
from engine.execution.model_shard import model_info
from engine.kv_cache.prefix_cache import PrefixCache
from engine.logs import logs_to_stderr
from engine.protocol.config import EngineConfig
from engine.protocol.generation_result import GenerationResult
from engine.protocol.messages import (
    EngineStats,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from engine.scheduling.request import Request
from engine.scheduling.scheduler import Scheduler
from engine.sleep.draft_memory import DraftMemory
from engine.sleep.model_memory import ModelMemory
from engine.sleep.sleeper import Sleeper
from engine.speculative.draft import draft_proposer
from engine.speculative.factory import make_proposer
from engine.speculative.verify import SpecDecoder
from engine.structured.structured_outputs import StructuredOutputs
from engine.weights.weight_updater import WeightUpdater
from engine.weights.weights_origin import WeightsOrigin


class LLMEngine(WeightAndSleepCalls, AdapterCalls):
    def __init__(self, config: EngineConfig) -> None:
        logs_to_stderr()  # in-process: the compile workers' and ranks' lines stay off stdout
        self.config = config
        self.lock = threading.RLock()  # step() and weight mutation from a trainer thread
        parts = load_model_parts(config, self.lock)
        cfg, self.model_config, self.workers = parts.model_config, parts.model_config, parts.workers
        self.device, self.lora = parts.device, parts.lora
        self.model, self.pool, self.runner = parts.shard.model, parts.shard.pool, parts.shard.runner
        self.cache = PrefixCache(self.pool, config.enable_prefix_cache)
        gate = adapter_gate(self.lora) if config.max_loras else None
        limits = (config.max_num_seqs, config.max_num_batched_tokens, config.policy_version)
        self.scheduler = Scheduler(self.cache, *limits, gate)
        self.structured = StructuredOutputs(grammars(config, parts))
        self.table = RequestTable(
            config, cfg, self.scheduler, self.pool, self.lora, self.structured
        )
        origin, abort = WeightsOrigin(str(parts.path)), self.table.abort
        self.memory = ModelMemory(self.model, self.pool, self.runner)
        draft = parts.draft
        self.updater = WeightUpdater(
            self.model,
            self.scheduler,
            self.cache,
            abort,
            self.runner.channel,
            origin,
            self.memory,
            draft=draft.model if draft is not None else None,
        )
        drafts = None if draft is None else DraftMemory(draft.model, draft.pool, draft.path)
        ids = self.table.request_ids
        self.sleeper = Sleeper(self.memory, self.cache, self.updater, abort, ids, drafts)
        post = Postprocessor(self.table, self.scheduler, self.cache, cfg.eos_token_ids)
        admin = (self.updater, self.sleeper, self.structured)
        overlapped = overlap_enabled(config)
        self.loop = StepLoop(self.table, self.scheduler, self.runner, post, admin, overlapped)
        load_draft = None if draft is None else functools.partial(draft_proposer, config, draft)
        if (proposer := make_proposer(config, load_draft)) is not None:
            spec = (config.num_speculative_tokens, config.speculative_max_batch)
            self.loop.speculate(SpecDecoder(proposer, *spec))
        self.info = model_info(
            config, cfg, parts.path, self.device, parts.dtype, self.pool.num_pages
        )
        self.warmup = self._warm_up() if config.warmup else None

    def _warm_up(self) -> dict[str, float]:
        """The start-up warm-up (engine/core/warmup.py), then nothing of it left behind."""
        prompts = warmup_prompts(self.config, self.model_config, self.pool)
        done = warm_up(self.add_request, self.step, self.has_work, prompts)
        self.cache.clear()
        self.loop.reset_counts()
        return done

    def flush_cache(self) -> int:
        """Forget every prefix-cache entry now (FlushCache); the unreferenced pages it freed.

        Running requests keep their pages (nothing is preempted) but no longer share them, and
        publish none of their later pages either: the index after a flush holds only what was
        computed after it, as the AllBlocksCleared it records says.
        """
        with self.lock:
            freed = self.cache.num_cached
            self.cache.clear()
            for req in self.scheduler.running:
                req.publish_pages = False
            return freed

    def close(self) -> None:
        """Stop the tensor-parallel workers (none with one rank); the engine is unusable after."""
        self.loop.drain()
        self.runner.close()
        self.structured.close()
        self.updater.transfer.leave()
        if self.workers is not None:
            self.workers.close()

    @property
    def overlap(self) -> StepLoop | None:
        """The step loop when it overlaps steps, else None."""
        return self.loop if self.loop.overlapped else None

    @property
    def requests(self) -> dict[str, list[Request]]:
        """Request id -> its n sequences, for every request in the scheduler."""
        return self.table.requests

    @property
    def policy_version(self) -> int:
        """The version of the served weights (the scheduler holds it: it hashes prefixes)."""
        return self.scheduler.policy_version

    # ---- requests in, steps ----

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        n: int = 1,
        priority: int = 0,
        deadline: float | None = None,
        min_policy_version: int | None = None,
    ) -> None:
        """Queue a request. Invalid input becomes that request's ERROR output, never an exception
        (except a request id already in flight, which is the caller's bug); a request while the
        engine sleeps (or drains into sleep) ends at once, ABORTED. A request with a
        structured-output constraint whose grammar is still compiling waits for it outside the
        scheduler (engine/core/request_table.py)."""
        when = (priority, deadline, min_policy_version)
        prompt = list(prompt_token_ids)
        self.table.add(request_id, prompt, params, n, when, self.sleeper.refusing)

    def abort(
        self,
        request_ids: Sequence[str],
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
        index: int | None = None,
    ) -> int:
        """End these requests now (only sample `index` when given; unknown ids are ignored);
        their pages return at once. Returns how many sequences ended."""
        return self.table.abort(request_ids, reason, message, index)

    def abort_all(self, reason: FinishReason, message: str | None = None) -> int:
        return self.table.abort(self.request_ids(), reason, message)

    def request_ids(self) -> list[str]:
        """Every request in flight, those waiting for their grammar included."""
        return self.table.request_ids()

    def has_work(self) -> bool:
        """Requests in flight (those waiting for their grammar included), or admin work."""
        return self.can_step() or bool(self.structured.deferred)

    def can_step(self) -> bool:
        """A step would do something now, not only wait for grammars to compile."""
        busy = self.scheduler.has_work() or self.updater.in_progress or self.sleeper.in_progress
        return busy or self.structured.ready or bool(self.table.pending) or self.loop.busy

    def step(self) -> Sequence[RequestOutput]:
        """Advance every scheduled request by one forward pass; return what changed."""
        with self.lock:
            return self.loop.step()

    def wait_for_grammars(self, timeout: float = 1.0) -> None:
        """Block while nothing is in flight but requests waiting for their grammar (at most
        `timeout` s): a caller's loop need not spin while they compile."""
        if self.structured.deferred and not self.can_step():
            self.structured.wait(timeout)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        n: int = 1,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in prompt order (n per prompt, by index)."""
        calls = (self.add_request, self.step, self.wait_for_grammars, self.table.next_id)
        return generate(*calls, prompts, params, n)

    def stats(self) -> EngineStats:
        """A consistent snapshot, policy version included."""
        with self.lock:
            return self.loop.stats()
