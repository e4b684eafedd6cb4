"""LLMEngine: the in-process API over the model, KV cache, scheduler and sampler.

Usable directly by a trainer in the same process (`generate`), and by the engine process's
pipe loop (`add_request` / `abort` / `step`). `step()` is: schedule (after step-boundary work:
expired deadlines, a pending weight swap), run, postprocess; with `overlap_steps` the run of
one step overlaps the host work of the next (engine/overlap.py). Every request ends with
exactly one output whose `finish_reason` is set (engine/request_outputs.py builds them;
engine/lifecycle.py starts requests and ends those refused, expired or too big;
engine/postprocess.py ends those a step's samples stop). Weight updates are WeightUpdater's
(engine/weights/weight_updater.py), sleep and wake Sleeper's (engine/sleep/sleeper.py), and the
calls that wait for them are in engine/in_process.py; `generate`'s results are
GenerationResult (engine/protocol/generation_result.py).

With `tensor_parallel_size` N > 1 this process is rank 0: it starts N-1 worker processes
(engine/parallel/worker_group.py), holds the scheduler, the page tables and the sampler, and its
model runner sends each step's inputs to the workers. `close()` stops them.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from engine import in_process, lifecycle
from engine.execution.launched_step import Sampled
from engine.execution.model_shard import (
    load_shard,
    model_info,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from engine.kv_cache.prefix_cache import PrefixCache
from engine.layers.kernel_choice import use_triton_kernels
from engine.logs import logs_to_stderr
from engine.lora.registry import AdapterRegistry, LoadedAdapter
from engine.models.hf_config import load_model_config
from engine.models.sharding import Sharding
from engine.overlap import OverlappedSteps, overlap_enabled
from engine.parallel.tensor_parallel import TensorParallel
from engine.parallel.worker_group import WorkerGroup
from engine.postprocess import append_sampled, publish_pages
from engine.protocol.config import EngineConfig
from engine.protocol.error_code import ErrorCode
from engine.protocol.generation_result import GenerationResult, generate
from engine.protocol.messages import (
    EngineStats,
    FinishReason,
    InflightPolicy,
    InitWeightTransfer,
    RequestOutput,
    SamplingParams,
    Sleep,
    SleepOutcome,
    UpdateWeights,
    Wake,
    WeightsProgress,
    WeightTransferJoined,
)
from engine.request_outputs import request_output
from engine.scheduling.request import Request
from engine.scheduling.scheduler import ScheduledBatch, Scheduler
from engine.sleep.model_memory import ModelMemory
from engine.sleep.sleeper import Sleeper
from engine.step_outputs import StepOutputs
from engine.structured.compile_pool import CompileLimits
from engine.structured.grammars import Grammars
from engine.structured.structured_outputs import StructuredOutputs
from engine.warmup import warm_up
from engine.weights.weight_updater import WeightUpdater
from engine.weights.weights_origin import WeightsOrigin


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        logs_to_stderr()  # in-process: the compile workers' and ranks' lines stay off stdout
        self.config = config
        size = config.tensor_parallel_size
        self.device = resolve_device(config.device, 0, size)
        self.dtype = resolve_dtype(config.dtype, self.device)
        path = resolve_model_path(config.model)
        cfg = load_model_config(path, config.max_model_len)
        self.model_config = cfg
        self.lock = threading.RLock()  # step() and weight mutation from a trainer thread
        self.workers: WorkerGroup | None = None
        tp = TensorParallel()
        if size > 1:
            Sharding(cfg, 0, size)  # a size that does not divide the model fails here, alone
            from engine.tp_worker import rank_threads, worker_main

            torch.set_num_threads(rank_threads(config))
            self.workers = WorkerGroup(config, path, self.device, worker_main)
            tp = self.workers.tp
        shard = load_shard(config, cfg, path, tp, self.device, self.dtype)
        self.model, self.pool, self.runner = shard.model, shard.pool, shard.runner
        if self.workers is not None:
            self.workers.attach(self.runner.open_channel(), self.lock)
        self.lora = self.runner.adapters = AdapterRegistry(
            self.model,
            config.max_loras,
            config.max_lora_rank,
            self.runner,
            triton=use_triton_kernels(config.layer_kernels, self.device),
        )
        self.cache = PrefixCache(self.pool, config.enable_prefix_cache)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler.policy_version = config.policy_version
        if config.max_loras:
            self.scheduler.adapter_gate = self._adapter_resident
        self.requests: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.pending: list[RequestOutput] = []  # produced outside step(): errors, aborts
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        origin = WeightsOrigin(str(path))
        channel = self.runner.channel
        self.updater = WeightUpdater(
            self.model, self.scheduler, self.cache, self.abort, channel, origin
        )
        self.memory = self.updater.storage = ModelMemory(self.model, self.pool, self.runner)
        self.sleeper = Sleeper(self.memory, self.cache, self.updater, self.abort, self.request_ids)
        limits = CompileLimits.of(config)
        grammars = Grammars(
            path, cfg.vocab_size, cfg.eos_token_ids, limits, json_whitespace=config.json_whitespace
        )
        self.structured = StructuredOutputs(grammars)
        self.overlap = OverlappedSteps(self) if overlap_enabled(config) else None
        self.info = model_info(config, cfg, path, self.device, self.dtype, self.pool.num_pages)
        self.warmup = warm_up(self) if config.warmup else None

    def close(self) -> None:
        """Stop the tensor-parallel workers (none with one rank); the engine is unusable after."""
        if self.overlap is not None:
            self.overlap.drain()
        self.runner.close()
        self.structured.close()
        self.updater.transfer.leave()
        if self.workers is not None:
            self.workers.close()

    # ---- requests in ----

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
        scheduler (engine/lifecycle.py)."""
        if request_id in self.requests or request_id in self.structured.deferred:
            raise ValueError(f"request id {request_id!r} is already in flight")
        prompt = list(prompt_token_ids)
        when = (priority, deadline, min_policy_version)
        lifecycle.add_request(self, request_id, prompt, params, n, *when)

    def abort(
        self,
        request_ids: Sequence[str],
        reason: FinishReason = FinishReason.CANCELLED,
        message: str | None = None,
        index: int | None = None,
    ) -> int:
        """End these requests now (only sample `index` when given; unknown ids are ignored);
        their pages return at once. Returns how many sequences ended."""
        ended = 0
        for request_id in request_ids:
            deferred = self.structured.drop(request_id)  # its compile may be cancelled
            if deferred is not None:  # as a whole: it has no sequences yet
                lifecycle.refuse(self, request_id, deferred.n, deferred.prompt_len, message, reason)
                ended += deferred.n
            for req in list(self.requests.get(request_id, [])):
                if not req.is_finished and index in (None, req.index):
                    self.finish(req, reason, message)
                    self.pending.append(request_output(req, [], None, None, self.policy_version))
                    ended += 1
        return ended

    def abort_all(self, reason: FinishReason, message: str | None = None) -> int:
        return self.abort(self.request_ids(), reason, message)

    def request_ids(self) -> list[str]:
        """Every request in flight, those waiting for their grammar included."""
        return [*self.requests, *self.structured.deferred]

    @property
    def policy_version(self) -> int:
        """The version of the served weights (the scheduler holds it: it hashes prefixes)."""
        return self.scheduler.policy_version

    def has_work(self) -> bool:
        """Requests in flight (those waiting for their grammar included), or admin work."""
        return self.can_step() or bool(self.structured.deferred)

    def can_step(self) -> bool:
        """A step would do something now, not only wait for grammars to compile."""
        busy = self.scheduler.has_work() or self.updater.in_progress or self.sleeper.in_progress
        busy = busy or self.structured.ready
        return busy or bool(self.pending) or (self.overlap is not None and self.overlap.busy)

    # ---- the step ----

    def step(self) -> Sequence[RequestOutput]:
        """Advance every scheduled request by one forward pass; return what changed."""
        with self.lock:
            return self._step()

    def _step(self) -> Sequence[RequestOutput]:
        if self.overlap is not None:
            return self.overlap.step()
        batch = self._schedule()
        outputs, self.pending = self.pending, []  # ended outside the batch: aborts, errors
        if batch:
            return self._postprocess(batch, self.runner.run(batch), outputs)
        return outputs

    def wait_for_grammars(self, timeout: float = 1.0) -> None:
        """Block while nothing is in flight but requests waiting for their grammar (at most
        `timeout` s): a caller's loop need not spin while they compile."""
        if self.structured.deferred and not self.can_step():
            self.structured.wait(timeout)

    def _schedule(self, hold: Collection[Request] = ()) -> ScheduledBatch:
        """Step-boundary work (deadlines, a pending weight swap or sleep), then the next
        batch."""
        lifecycle.expire_deadlines(self)
        self.updater.advance()
        self.sleeper.advance()
        self.structured.start_ready()
        batch = self.scheduler.schedule(hold)
        lifecycle.end_too_big(self)
        now = time.monotonic()
        for req in [r for r in batch.requests if r.first_scheduled_time is None]:
            req.first_scheduled_time = now
        return batch

    def _postprocess(
        self, batch: ScheduledBatch, sampled: Sampled, first: list[RequestOutput]
    ) -> StepOutputs:
        """Count the computed tokens, publish full pages to the prefix cache, append the
        sampled tokens; returns `first`, then one output per sampled row."""
        self._advance(batch)
        self._publish(batch.requests, [r.num_computed_tokens for r in batch.requests])
        return self._append_sampled(sampled, first)

    def _advance(self, batch: ScheduledBatch) -> None:
        reqs, lens = batch.requests, batch.query_lens
        for req, num_tokens in zip(reqs, lens, strict=True):
            req.num_computed_tokens += num_tokens
        prompt = [
            n for r, n in zip(reqs, lens, strict=True) if r.num_computed_tokens <= r.prompt_len
        ]
        self.prompt_tokens_computed += sum(prompt)

    def _publish(self, reqs: list[Request], computed: list[int]) -> None:
        publish_pages(self, reqs, computed)

    def _append_sampled(self, sampled: Sampled, first: list[RequestOutput]) -> StepOutputs:
        return append_sampled(self, sampled, first)

    def finish(self, req: Request, reason: FinishReason, message: str | None) -> None:
        """End `req` now: the one way a sequence ends (engine/lifecycle.py)."""
        lifecycle.finish(self, req, reason, message)

    # ---- stats ----

    def stats(self) -> EngineStats:
        """A consistent snapshot, policy version included."""
        with self.lock:
            return self._stats()

    def _stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.structured.deferred),
            total_pages=self.pool.num_pages,
            free_pages=self.pool.num_free,
            cached_pages=self.cache.num_cached,
            policy_version=self.policy_version,
            prompt_tokens_computed=self.prompt_tokens_computed,
            tokens_generated=self.tokens_generated,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            preemptions=self.scheduler.num_preemptions,
            updating_weights=self.updater.in_progress,
            sleep_level=self.sleeper.level,
        )

    # ---- weight updates (the state machine is WeightUpdater's) ----

    def start_weight_update(
        self, msg: UpdateWeights, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Accept an update; it applies now (ABORT, CONTINUE, RECOMPUTE) or once running
        requests have finished (DRAIN). Progress goes to `updater.sink` (or `updater.events`),
        ending with one APPLIED or FAILED. `tensors` is the in-process source (no file, no
        checkpoint)."""
        with self.lock:
            self._settle()
            if self.sleeper.in_progress:
                self.updater.refuse(msg, ErrorCode.FAILED_PRECONDITION, "a sleep is draining")
                return
            self.updater.start(msg, tensors)

    def begin_weight_transfer(self, msg: InitWeightTransfer) -> WeightTransferJoined | None:
        """Start joining a trainer's process group on every rank (msg.group None: leave it),
        for updates with a `distributed` source; steps go on meanwhile. The answer now (a
        leave, a refusal), or None: `settle_weight_transfer` answers once the join settles, at
        most the group's timeout later."""
        with self.lock:
            return self.updater.begin_join(msg)

    def settle_weight_transfer(self) -> WeightTransferJoined | None:
        """The answer of the join under way once it has settled, else None (cheap: the
        process loop calls it every iteration)."""
        if self.updater.joining is None:
            return None
        with self.lock:
            return self.updater.settle_join()

    def join_weight_transfer(self, msg: InitWeightTransfer) -> WeightTransferJoined:
        """begin_weight_transfer, then wait for its answer (in-process callers)."""
        answer = self.begin_weight_transfer(msg)
        while answer is None:
            joining = self.updater.transfer.joining
            if joining is not None:
                joining.wait(joining.due_in())
            answer = self.settle_weight_transfer()
        return answer

    def update_weights(
        self,
        source: str | Path | Mapping[str, torch.Tensor],
        policy_version: int = 0,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
        drain_timeout: float | None = None,
    ) -> WeightsProgress:
        """An update from a checkpoint directory or named tensors, applied before it returns
        (engine/in_process.py)."""
        return in_process.update_weights(self, source, policy_version, inflight, drain_timeout)

    @contextlib.contextmanager
    def live_weights(self, policy_version: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Mutate the served parameters in place (a trainer in this process), then publish the
        new version on exit. Holds the engine lock throughout; running requests continue on
        their KV (CONTINUE). Nothing is published if the block raises."""
        with self.lock:
            self._settle()
            with self.updater.live(policy_version) as params:
                yield params

    # ---- LoRA adapters (engine/lora/registry.py) ----

    def load_adapter(
        self, name: str, path: str | Path, pinned: bool = False, version: int = 1
    ) -> LoadedAdapter:
        """Load the PEFT adapter directory `path` as `name` at policy `version` for requests that
        name it (resident now or when a slot frees; a pinned one keeps its slot). ValueError,
        nothing changed, when it does not fit (shapes, target modules, rank, pinning)."""
        with self.lock:
            return self.lora.load(name, path, pinned, self._adapters_running(), version)

    def unload_adapter(self, name: str) -> None:
        """ValueError when `name` is not loaded or a request in flight runs it."""
        with self.lock:
            key = self.lora.key_of(name)
            users = [i for i, seqs in self.requests.items() if key and seqs[0].adapter_key == key]
            if users:
                raise ValueError(f"adapter {name!r}: {len(users)} requests in flight run it")
            self.lora.unload(name)

    def adapters(self) -> list[LoadedAdapter]:
        with self.lock:
            return list(self.lora.loaded.values())

    def _adapters_running(self) -> set[int]:
        return {r.adapter_key for r in self.scheduler.running}

    def _adapter_resident(self, req: Request) -> bool:
        return self.lora.make_resident(req.adapter_key, self._adapters_running())

    # ---- sleep and wake (the state machine is Sleeper's) ----

    def sleep(
        self,
        level: int = 1,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
        drain_timeout: float | None = None,
    ) -> SleepOutcome:
        """Free the KV cache (level 1) and the weights too (level 2) until wake_up(), done
        before it returns (engine/in_process.py)."""
        return in_process.sleep(self, level, inflight, drain_timeout)

    def wake_up(self) -> SleepOutcome:
        """Serve again after sleep() (engine/in_process.py)."""
        return in_process.wake_up(self)

    def start_sleep(self, msg: Sleep) -> None:
        """Accept a Sleep; its SleepOutcome goes to `sleeper.sink` (or `sleeper.events`)."""
        with self.lock:
            self._settle()
            self.sleeper.start(msg)

    def wake(self, msg: Wake) -> None:
        with self.lock:
            self.sleeper.wake(msg)

    def _step_into_pending(self) -> None:
        """One step whose outputs wait in `pending` for the caller's next step()."""
        # NOTE: not `self.pending += self.step()`: step() returns outputs that hold the old
        # `pending` list itself, which would then be extended with its own items.
        outputs = list(self.step())
        self.pending += outputs

    def _settle(self) -> None:
        """Nothing in flight (a weight swap needs it): the launched step is undone, so the
        swap lands where a plain loop's would (engine/overlap.py)."""
        if self.overlap is not None:
            self.pending += self.overlap.rewind()

    # ---- batch API ----

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        n: int = 1,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in prompt order (n per prompt, by index)."""
        return generate(self, prompts, params, n)
