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

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from engine.core import in_process
from engine.core.generate import generate
from engine.core.model_parts import grammars, load_model_parts
from engine.core.postprocess import Postprocessor
from engine.core.request_table import RequestTable
from engine.core.step_loop import StepLoop, overlap_enabled
from engine.core.warmup import warm_up, warmup_prompts
from engine.execution.model_shard import model_info
from engine.kv_cache.prefix_cache import PrefixCache
from engine.logs import logs_to_stderr
from engine.lora.adapter_update import replace_adapter
from engine.lora.registry import LoadedAdapter
from engine.protocol.config import EngineConfig
from engine.protocol.error_code import ErrorCode
from engine.protocol.generation_result import GenerationResult
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
from engine.scheduling.request import Request
from engine.scheduling.scheduler import Scheduler
from engine.sleep.model_memory import ModelMemory
from engine.sleep.sleeper import Sleeper
from engine.structured.structured_outputs import StructuredOutputs
from engine.weights.weight_updater import WeightUpdater
from engine.weights.weights_origin import WeightsOrigin


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        logs_to_stderr()  # in-process: the compile workers' and ranks' lines stay off stdout
        self.config = config
        self.lock = threading.RLock()  # step() and weight mutation from a trainer thread
        parts = load_model_parts(config, self.lock)
        cfg, self.model_config, self.workers = parts.model_config, parts.model_config, parts.workers
        self.device, self.lora = parts.device, parts.lora
        self.model, self.pool, self.runner = parts.shard.model, parts.shard.pool, parts.shard.runner
        self.cache = PrefixCache(self.pool, config.enable_prefix_cache)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler.policy_version = config.policy_version
        if config.max_loras:
            self.scheduler.adapter_gate = self._adapter_resident
        self.structured = StructuredOutputs(grammars(config, parts))
        self.table = RequestTable(
            config, cfg, self.scheduler, self.pool, self.lora, self.structured
        )
        origin, abort = WeightsOrigin(str(parts.path)), self.table.abort
        self.updater = WeightUpdater(
            self.model, self.scheduler, self.cache, abort, self.runner.channel, origin
        )
        self.memory = self.updater.storage = ModelMemory(self.model, self.pool, self.runner)
        self.sleeper = Sleeper(self.memory, self.cache, self.updater, abort, self.table.request_ids)
        post = Postprocessor(self.table, self.scheduler, self.cache, cfg.eos_token_ids)
        admin = (self.updater, self.sleeper, self.structured)
        overlapped = overlap_enabled(config)
        self.loop = StepLoop(self.table, self.scheduler, self.runner, post, admin, overlapped)
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

    # ---- weights, sleep (the state machines are WeightUpdater's and Sleeper's) ----

    def start_weight_update(
        self, msg: UpdateWeights, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Accept an update; it applies now (ABORT, CONTINUE, RECOMPUTE) or once running
        requests have finished (DRAIN). Progress goes to `updater.sink` (or `updater.events`),
        ending with one APPLIED or FAILED. `tensors` is the in-process source (no file, no
        checkpoint)."""
        with self.lock:
            self.loop.settle()
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

    @contextlib.contextmanager
    def live_weights(self, policy_version: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Mutate the served parameters in place (a trainer in this process), then publish the
        new version on exit. Holds the engine lock throughout; running requests continue on
        their KV (CONTINUE). Nothing is published if the block raises."""
        with self.lock:
            self.loop.settle()
            with self.updater.live(policy_version) as params:
                yield params

    def start_sleep(self, msg: Sleep) -> None:
        """Accept a Sleep; its SleepOutcome goes to `sleeper.sink` (or `sleeper.events`)."""
        with self.lock:
            self.loop.settle()
            self.sleeper.start(msg)

    def wake(self, msg: Wake) -> None:
        with self.lock:
            self.sleeper.wake(msg)

    # ---- the in-process calls that wait for their outcome (engine/core/in_process.py) ----

    def update_weights(
        self,
        source: str | Path | Mapping[str, torch.Tensor],
        policy_version: int = 0,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
        drain_timeout: float | None = None,
    ) -> WeightsProgress:
        """An update from a checkpoint directory or named tensors, applied before it returns."""
        calls = (self.start_weight_update, self.updater, self._step_into_pending)
        update_id, how = self.table.next_id("in-process"), (inflight, drain_timeout)
        return in_process.update_weights(*calls, update_id, source, policy_version, *how)

    def sleep(
        self,
        level: int = 1,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
        drain_timeout: float | None = None,
    ) -> SleepOutcome:
        """Free the KV cache (level 1) and the weights too (level 2) until wake_up(), done
        before it returns."""
        calls = (self.start_sleep, self.sleeper, self._step_into_pending)
        sleep_id = self.table.next_id("in-process")
        return in_process.sleep(*calls, sleep_id, level, inflight, drain_timeout)

    def wake_up(self) -> SleepOutcome:
        """Serve again after sleep()."""
        return in_process.wake_up(self.wake, self.sleeper, self.table.next_id("in-process"))

    def join_weight_transfer(self, msg: InitWeightTransfer) -> WeightTransferJoined:
        """begin_weight_transfer, then wait for its answer."""
        calls = (self.begin_weight_transfer, self.settle_weight_transfer, self.updater)
        return in_process.join_weight_transfer(*calls, msg)

    def _step_into_pending(self) -> None:
        """One step whose outputs wait in the table for the caller's next step()."""
        # NOTE: not `pending += self.step()` in one: step() returns outputs that may hold the
        # old pending list itself, which would then be extended with its own items.
        outputs = list(self.step())
        self.table.pending += outputs

    # ---- LoRA adapters (engine/lora/registry.py) ----

    def load_adapter(
        self, name: str, path: str | Path, pinned: bool = False, version: int = 1
    ) -> LoadedAdapter:
        """Load the PEFT adapter directory `path` as `name` at policy `version` for requests that
        name it (resident now or when a slot frees; a pinned one keeps its slot). ValueError,
        nothing changed, when it does not fit (shapes, target modules, rank, pinning)."""
        with self.lock:
            return self.lora.load(name, path, pinned, self._adapters_running(), version)

    def replace_adapter(
        self,
        name: str,
        path: str | Path,
        policy_version: int = 0,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
    ) -> LoadedAdapter:
        """Update the loaded adapter `name` in place (engine/lora/adapter_update.py)."""
        with self.lock:
            self.loop.settle()  # NOTE: a launched step's tokens must report the version it ran
            seqs = [s for seqs in self.table.requests.values() for s in seqs]
            return replace_adapter(
                self.lora,
                self.scheduler,
                self.table.abort,
                seqs,
                name,
                path,
                policy_version,
                inflight,
            )

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
