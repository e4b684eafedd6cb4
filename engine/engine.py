"""LLMEngine: the in-process API over the model, KV cache, scheduler and sampler.

Usable directly by a trainer in the same process (`generate`), and by the engine process's
pipe loop (`add_request` / `abort` / `step`). `step()` is: expire deadlines, schedule, run,
postprocess. Every request ends with exactly one output whose `finish_reason` is set.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.attention import make_backend
from engine.config import EngineConfig
from engine.messages import (
    MAX_POLICY_VERSION,
    EngineStats,
    FinishReason,
    InflightPolicy,
    ModelInfo,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
)
from engine.model_runner import ModelRunner, Sampled
from engine.models.hf_config import load_model_config
from engine.page_pool import PagePool
from engine.prefix_cache import PrefixCache
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.weight_update import (
    StagedWeights,
    WeightUpdateError,
    stage_checkpoint,
    stage_tensor_file,
    stage_tensors,
)
from engine.weights import build_model

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on the CPU
GPU_MEMORY_FRACTION = 0.9  # of the memory free after loading weights, for KV on CUDA


@dataclass
class PendingUpdate:
    """A weight update accepted but not yet applied (DRAIN waits for running requests)."""

    msg: UpdateWeights
    version: int  # the version it will publish
    started: float  # time.monotonic()
    tensors: Mapping[str, torch.Tensor] | None = None  # in-process source
    last_progress: float = 0.0


@dataclass
class GenerationResult:
    """One completion from `LLMEngine.generate`."""

    prompt_token_ids: list[int]
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    policy_versions: list[int] = field(default_factory=list)  # one per token
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self.dtype = _resolve_dtype(config.dtype, self.device)
        path = _resolve_model_path(config.model)
        cfg = load_model_config(path, config.max_model_len)
        self.model_config = cfg
        backend = make_backend(
            config.attention_backend, self.device, cfg.head_dim**-0.5, config.page_size
        )
        self.model = build_model(cfg, path, backend, self.device, self.dtype)
        self.pool = PagePool(
            self._num_pages(),
            config.page_size,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.cache = PrefixCache(self.pool, config.enable_prefix_cache)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.device,
            cfg.eos_token_ids,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.attach_graphs(capture=True, compile=config.compile)
        elif config.compile:
            self.runner.attach_graphs(capture=False, compile=True)
        self.policy_version = config.policy_version
        self.scheduler.policy_version = config.policy_version
        self.requests: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.pending: list[RequestOutput] = []  # produced outside step(): errors, aborts
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self.update: PendingUpdate | None = None
        # Weight-update progress goes to `weights_sink` as it happens when one is installed
        # (the process loop sends it down the pipe, so a long staging is never silent), else
        # it collects in `weight_events`.
        self.weights_sink: Callable[[WeightsProgress], None] | None = None
        self.weight_events: list[WeightsProgress] = []
        self.last_final: WeightsProgress | None = None  # the last APPLIED or FAILED
        self.lock = threading.RLock()  # step() and weight mutation from a trainer thread
        name = "demo" if config.model == "demo" else Path(config.model).name
        self.info = ModelInfo(
            model=name,
            path=str(path),
            architecture=cfg.architecture,
            max_model_len=cfg.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            page_size=config.page_size,
            total_pages=self.pool.num_pages,
            policy_version=self.policy_version,
            max_num_seqs=config.max_num_seqs,
        )

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
        (except a request id already in flight, which is the caller's bug)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        prompt = list(prompt_token_ids)
        error = self._validate(prompt, params, n, min_policy_version)
        if error is not None:
            for index in range(max(n, 1)):
                self.pending.append(self._error_output(request_id, index, len(prompt), error))
            return
        max_tokens = self.model_config.max_model_len - len(prompt)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        seqs = []
        for index in range(n):
            seed = params.seed + index if params.seed is not None else self._rng.getrandbits(64)
            seqs.append(
                Request(
                    request_id=request_id,
                    index=index,
                    prompt_len=len(prompt),
                    token_ids=list(prompt),
                    params=params,
                    seed=seed % 2**64,
                    max_tokens=max_tokens,
                    arrival_seq=next(self._arrivals),
                    priority=priority,
                    deadline=deadline,
                )
            )
        leader, siblings = seqs[0], seqs[1:]
        for sibling in siblings:
            sibling.status = RequestStatus.FORK_PENDING
        leader.pending_forks = list(siblings)
        self.scheduler.add(leader)
        self.requests[request_id] = seqs

    def _validate(
        self, prompt: list[int], params: SamplingParams, n: int, min_version: int | None
    ) -> str | None:
        vocab, max_len = self.model_config.vocab_size, self.model_config.max_model_len
        if not prompt:
            return "prompt: is empty"
        if len(prompt) >= max_len:
            return f"prompt: {len(prompt)} tokens leave no room in the context of {max_len}"
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt: token id {bad} is outside the vocabulary [0, {vocab})"
        if not 1 <= n <= self.config.max_num_seqs:
            return f"n: must be in [1, max_num_seqs={self.config.max_num_seqs}]"
        errors = params.errors(vocab)
        if errors:
            return "; ".join(f"{name}: {why}" for name, why in errors)
        if min_version is not None and min_version > self.policy_version:
            return f"min_policy_version: {min_version} > served version {self.policy_version}"
        return None

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
            for req in list(self.requests.get(request_id, [])):
                if not req.is_finished and index in (None, req.index):
                    self._finish(req, reason, message)
                    self.pending.append(self._output(req, [], None, None))
                    ended += 1
        return ended

    def abort_all(self, reason: FinishReason, message: str | None = None) -> int:
        return self.abort(list(self.requests), reason, message)

    def has_work(self) -> bool:
        return bool(self.pending) or self.scheduler.has_work() or self.update is not None

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one forward pass; return what changed."""
        with self.lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self._expire_deadlines()
        self._advance_update()
        batch = self.scheduler.schedule()
        self._end_too_big()
        outputs, self.pending = self.pending, []
        if not batch:
            return outputs
        now = time.monotonic()
        for req in batch.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        sampled = self.runner.run(batch)
        for req, num_tokens in zip(batch.requests, batch.query_lens, strict=True):
            req.num_computed_tokens += num_tokens
            if req.num_computed_tokens <= req.prompt_len:
                self.prompt_tokens_computed += num_tokens
            if req.publish_pages:
                self.cache.publish(
                    self.policy_version,
                    req.token_ids,
                    req.pages,
                    req.num_computed_tokens,
                    req.page_hashes,
                )
        outputs += self._append_sampled(sampled)
        return outputs

    def _append_sampled(self, sampled: Sampled) -> list[RequestOutput]:
        # NOTE: siblings fork before any token is appended: a leader that stops at its first
        # token releases the prompt pages they start from.
        for req in sampled.requests:
            if req.status is RequestStatus.FORK_PENDING:
                self.scheduler.fork(req, self.requests[req.request_id][0])
        outputs = []
        now = time.monotonic()
        for row, req in enumerate(sampled.requests):
            token = sampled.token_ids[row]
            req.token_ids.append(token)
            self.tokens_generated += 1
            if req.first_token_time is None:
                req.first_token_time = now
            logprobs = None
            if req.params.logprobs and sampled.logprobs is not None:
                logprobs = [sampled.logprobs[row]]
            top = None
            k = req.params.top_logprobs
            if k and sampled.top_ids is not None and sampled.top_logprobs is not None:
                top = [(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k])]
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason, None)
            outputs.append(self._output(req, [token], logprobs, top))
        return outputs

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if not params.ignore_eos and token in self.model_config.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens:
            return FinishReason.LENGTH
        return None

    def _expire_deadlines(self) -> None:
        now = time.time()
        expired = [
            req_id
            for req_id, seqs in self.requests.items()
            if seqs[0].deadline is not None and seqs[0].deadline <= now
        ]
        if expired:
            self.abort(expired, FinishReason.DEADLINE_EXCEEDED, "the deadline passed")

    def _end_too_big(self) -> None:
        for req in self.scheduler.too_big:
            need = self.pool.pages_for(req.num_tokens + 1)
            message = (
                f"the request needs {need} KV pages but the whole cache has {self.pool.num_pages}"
            )
            # Pending siblings go to the queue on their own and end the same way next step.
            self._finish(req, FinishReason.ERROR, message)
            self.pending.append(self._output(req, [], None, None))

        self.scheduler.too_big.clear()

    def _finish(self, req: Request, reason: FinishReason, message: str | None) -> None:
        if req.status is not RequestStatus.FINISHED:  # the scheduler ends requests too big to fit
            self.scheduler.remove(req, leader=self.requests[req.request_id][0])
        for sibling in req.pending_forks:  # a leader ended early: they compute the prompt alone
            self.scheduler.add(sibling)
        req.pending_forks = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = message
        req.finish_time = time.monotonic()
        seqs = self.requests.get(req.request_id, [])
        if all(s.is_finished for s in seqs):
            self.requests.pop(req.request_id, None)

    # ---- outputs ----

    def _output(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[float] | None,
        top: list[tuple[list[int], list[float]]] | None,
    ) -> RequestOutput:
        metrics = None
        if req.is_finished and req.finish_time is not None:
            first_token = req.first_token_time or req.finish_time
            metrics = RequestMetrics(
                queue_time=(req.first_scheduled_time or req.finish_time) - req.arrival_time,
                time_to_first_token=first_token - req.arrival_time,
                decode_time=req.finish_time - first_token,
            )
        return RequestOutput(
            request_id=req.request_id,
            index=req.index,
            new_token_ids=tokens,
            policy_version=self.policy_version,
            logprobs=logprobs,
            top_logprobs=top,
            finish_reason=req.finish_reason,
            error=req.error,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.num_cached_tokens,
            completion_tokens=req.num_output_tokens,
            metrics=metrics,
        )

    def _error_output(
        self, request_id: str, index: int, prompt_len: int, error: str
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            index=index,
            new_token_ids=[],
            policy_version=self.policy_version,
            finish_reason=FinishReason.ERROR,
            error=error,
            prompt_tokens=prompt_len,
        )

    def stats(self) -> EngineStats:
        """A consistent snapshot, policy version included."""
        with self.lock:
            return self._stats()

    def _stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            total_pages=self.pool.num_pages,
            free_pages=self.pool.num_free,
            cached_pages=self.cache.num_cached,
            policy_version=self.policy_version,
            prompt_tokens_computed=self.prompt_tokens_computed,
            tokens_generated=self.tokens_generated,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            preemptions=self.scheduler.num_preemptions,
            updating_weights=self.update is not None,
        )

    # ---- weight updates ----

    def start_weight_update(
        self, msg: UpdateWeights, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Accept an update; it applies now (ABORT, CONTINUE, RECOMPUTE) or once running
        requests have finished (DRAIN). Progress goes to `weights_sink` (or `weight_events`),
        ending with one APPLIED or FAILED. `tensors` is the in-process source (no file, no
        checkpoint)."""
        with self.lock:
            if self.update is not None:
                self._weights_failed(msg, "FAILED_PRECONDITION", "an update is in progress")
                return
            version = msg.policy_version or self.policy_version + 1
            refusal = self._version_refusal(version)
            if refusal is not None:
                self._weights_failed(msg, *refusal)
                return
            self.update = PendingUpdate(msg, version, time.monotonic(), tensors)
            self._weights_event(WeightsPhase.PAUSED, in_flight=len(self.scheduler.running))
            if msg.inflight is InflightPolicy.DRAIN:
                self.scheduler.admitting = False  # new requests wait; _advance_update swaps
            else:
                self._swap_weights()

    def update_weights(
        self,
        source: str | Path | Mapping[str, torch.Tensor],
        policy_version: int = 0,
        inflight: InflightPolicy = InflightPolicy.DRAIN,
        drain_timeout: float | None = None,
    ) -> WeightsProgress:
        """In-process update from a checkpoint directory or named tensors; returns APPLIED or
        raises WeightUpdateError (FAILED_PRECONDITION: the version is not above the served
        one or another update is in progress; OUT_OF_RANGE: it would pass MAX_POLICY_VERSION;
        INVALID_ARGUMENT: bad tensors). DRAIN steps running requests to completion first:
        their outputs are returned by the next step()."""
        tensors = None if isinstance(source, str | Path) else source
        msg = UpdateWeights(
            update_id=f"in-process-{next(self._arrivals)}",
            policy_version=policy_version,
            inflight=inflight,
            checkpoint_dir=str(source) if tensors is None else None,
            drain_timeout=drain_timeout,
        )
        self.start_weight_update(msg, tensors)
        while self.update is not None and self.update.msg is msg:
            self.pending += self.step()
        self.weight_events = [e for e in self.weight_events if e.update_id != msg.update_id]
        final = self.last_final
        assert final is not None and final.update_id == msg.update_id
        if final.phase is WeightsPhase.FAILED:
            raise WeightUpdateError(final.error_code, final.message)
        return final

    @contextlib.contextmanager
    def live_weights(self, policy_version: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Mutate the served parameters in place (a trainer in this process), then publish the
        new version on exit. Holds the engine lock throughout; running requests continue on
        their KV (CONTINUE). Nothing is published if the block raises."""
        with self.lock:
            if self.update is not None:
                raise WeightUpdateError("FAILED_PRECONDITION", "an update is in progress")
            version = policy_version or self.policy_version + 1
            refusal = self._version_refusal(version)
            if refusal is not None:
                raise WeightUpdateError(*refusal)
            yield dict(self.model.named_parameters())
            self._publish_version(version, InflightPolicy.CONTINUE)

    def _version_refusal(self, version: int) -> tuple[str, str] | None:
        """(error code, why) when `version` cannot be the next served version."""
        if version > MAX_POLICY_VERSION:
            return "OUT_OF_RANGE", f"policy_version {version} exceeds {MAX_POLICY_VERSION}"
        if version <= self.policy_version:
            return (
                "FAILED_PRECONDITION",
                f"policy_version {version} must exceed the served {self.policy_version}",
            )
        return None

    def _advance_update(self) -> None:
        """At a step boundary: swap a draining update once nothing runs, or time it out."""
        update = self.update
        if update is None or update.msg.inflight is not InflightPolicy.DRAIN:
            return
        if not self.scheduler.running:
            self._swap_weights()
        elif update.msg.drain_timeout is not None:
            waited = time.monotonic() - update.started
            if waited > update.msg.drain_timeout:
                running = len(self.scheduler.running)
                why = f"drain timed out after {waited:.1f}s with {running} requests running"
                self._end_update(WeightsPhase.FAILED, error_code="ABORTED", message=why)

    def _swap_weights(self) -> None:
        """Stage (validate) the new tensors, handle running requests, swap, publish."""
        update = self.update
        assert update is not None
        try:
            staged = self._stage(update)
        except WeightUpdateError as exc:
            self._end_update(WeightsPhase.FAILED, error_code=exc.code, message=exc.message)
            return
        running = list(self.scheduler.running)
        counts = {"aborted": 0, "continued": 0, "recomputed": 0}
        match update.msg.inflight:
            case InflightPolicy.ABORT:
                why = f"aborted by a weight update to policy version {update.version}"
                ids = list(dict.fromkeys(req.request_id for req in running))
                counts["aborted"] = self.abort(ids, FinishReason.ABORTED, why)
            case InflightPolicy.RECOMPUTE:
                counts["recomputed"] = len(running)
                for req in running:
                    self.scheduler.preempt(req)
            case InflightPolicy.CONTINUE:
                counts["continued"] = len(running)
        staged.apply()
        previous = self.policy_version
        self._publish_version(update.version, update.msg.inflight)
        self._end_update(WeightsPhase.APPLIED, previous_version=previous, **counts)

    def _stage(self, update: PendingUpdate) -> StagedWeights:
        params = dict(self.model.named_parameters())
        msg = update.msg

        def progress(bytes_done: int, tensors_done: int) -> None:
            now = time.monotonic()
            if now - update.last_progress >= 0.1:
                update.last_progress = now
                self._weights_event(
                    WeightsPhase.LOADING, bytes_done=bytes_done, tensors_done=tensors_done
                )

        if update.tensors is not None:
            staged = stage_tensors(params, update.tensors)
        elif msg.checkpoint_dir is not None:
            staged = stage_checkpoint(params, msg.checkpoint_dir, progress)
        elif msg.tensor_file is not None:
            staged = stage_tensor_file(params, msg.tensor_file, msg.tensors, progress)
        else:
            raise WeightUpdateError("INVALID_ARGUMENT", "the update names no source")
        total, count = staged.nbytes, len(staged.tensors)
        self._weights_event(
            WeightsPhase.LOADING,
            bytes_done=total,
            bytes_total=total,
            tensors_done=count,
            tensors_total=count,
        )
        return staged

    def _publish_version(self, version: int, inflight: InflightPolicy) -> None:
        """Make `version` the served one. Cached prefixes of older weights are dropped; the KV
        that running requests keep (CONTINUE) mixes versions, so it is never published."""
        self.policy_version = self.scheduler.policy_version = version
        self.cache.clear()
        if inflight is InflightPolicy.CONTINUE:
            for req in self.scheduler.running:
                req.publish_pages = False

    def _weights_event(self, phase: WeightsPhase, **fields: Any) -> None:
        update = self.update
        assert update is not None
        event = WeightsProgress(
            update.msg.update_id, phase, policy_version=update.version, **fields
        )
        self._emit(event)

    def _end_update(self, phase: WeightsPhase, **fields: Any) -> None:
        assert self.update is not None
        self._weights_event(phase, seconds=time.monotonic() - self.update.started, **fields)
        self.update = None
        self.scheduler.admitting = True

    def _weights_failed(self, msg: UpdateWeights, code: str, message: str) -> None:
        failed = WeightsProgress(
            msg.update_id, WeightsPhase.FAILED, error_code=code, message=message
        )
        self._emit(failed)

    def _emit(self, event: WeightsProgress) -> None:
        if event.final:
            self.last_final = event
        if self.weights_sink is not None:
            self.weights_sink(event)
        else:
            self.weight_events.append(event)

    # ---- batch API ----

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        n: int = 1,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in prompt order (n per prompt, by index)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        results: dict[tuple[str, int], GenerationResult] = {}
        ids = []
        for k, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            request_id = f"generate-{next(self._arrivals)}-{k}"
            ids.append(request_id)
            for index in range(n):
                results[(request_id, index)] = GenerationResult(list(prompt), index)
            self.add_request(request_id, prompt, p, n=n)
        remaining = len(results)
        while remaining:
            for out in self.step():
                result = results.get((out.request_id, out.index))
                if result is None:
                    continue  # another caller's request
                _accumulate(result, out)
                remaining -= out.finished
        return [results[(rid, i)] for rid in ids for i in range(n)]

    def _num_pages(self) -> int:
        cfg, config = self.model_config, self.config
        if config.num_kv_pages is not None:
            return config.num_kv_pages
        per_page = PagePool.bytes_per_page(
            config.page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )
        budget = config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * GPU_MEMORY_FRACTION)
        elif budget is None:
            # Enough for every sequence at full length, within a fixed CPU budget.
            full = config.max_num_seqs * -(-cfg.max_model_len // config.page_size)
            budget = min(CPU_KV_CACHE_BYTES, full * per_page)
        pages = budget // per_page
        if pages < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold no {per_page}-byte page")
        return pages


def _accumulate(result: GenerationResult, out: RequestOutput) -> None:
    result.token_ids += out.new_token_ids
    result.policy_versions += [out.policy_version] * len(out.new_token_ids)
    if out.logprobs is not None:
        result.logprobs = (result.logprobs or []) + out.logprobs
    if out.top_logprobs is not None:
        result.top_logprobs = (result.top_logprobs or []) + out.top_logprobs
    result.prompt_tokens = out.prompt_tokens
    result.completion_tokens = out.completion_tokens
    result.cached_tokens = out.cached_tokens
    if out.finished:
        result.finish_reason = out.finish_reason
        result.error = out.error


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _resolve_model_path(model: str) -> Path:
    if model == "demo":
        from engine.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    return Path(model)
