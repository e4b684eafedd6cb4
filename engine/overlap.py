"""OverlappedSteps: LLMEngine's step loop with the host one step ahead of the device.

`step()` launches step N+1 before it collects step N: while the device computes N, the host
schedules N+1 and writes its inputs. A token sampled at N is needed on the host only where it
changes the schedule, so until N is collected every request that samples at N carries a
placeholder, PENDING, at the end of its tokens:
- the scheduler sees a request with one token left to compute and schedules it as a decode;
  its input id is read on the device from N's sampled ids (engine/execution/launched_step.py);
- the sampler's noise counter (the number of output tokens) counts the placeholder, so a
  seeded request draws the same noise as in the plain loop;
- collecting N replaces the placeholder: the token is appended as the plain loop would (stop
  checks, outputs, prefix-cache publishing of pages whose tokens are all known), and the
  placeholder of N+1 goes back behind it. A request that ended at N (stop token, length, abort,
  deadline) has its N+1 row discarded; its pages were freed when it ended (the device reads
  them in order, before any later step that reuses them).
Requests whose pending token may end them in a way that changes the schedule are held out of
N+1: those that reach max_tokens (they end for sure) and those whose next page would not fit in
the whole pool (the plain loop ends them with ERROR unless the token stops them first).

Some steps are not overlapped: step N is collected before N+1 is scheduled while a weight
update or a sleep is in progress (a swap, or freeing the KV pool, needs nothing in flight),
when N sampled the first tokens of n > 1 siblings (forking copies KV pages on the host's side),
and when a request sampled at N uses penalties, bad words of two or more tokens or a
structured-output grammar (the sampler reads its tokens on the host: its history, or its
grammar's state after N's token). N+1's grammar mask is then computed while N+1's forward runs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.execution.launched_step import LaunchedStep, PendingInputs, Sampled
from engine.execution.model_runner import ModelRunner
from engine.kv_cache.page_pool import PagePool
from engine.protocol.config import EngineConfig
from engine.protocol.messages import RequestOutput
from engine.sampling.sampling_slots import reads_history
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import ScheduledBatch, Scheduler
from engine.sleep.sleeper import Sleeper
from engine.step_outputs import StepOutputs
from engine.weights.weight_updater import WeightUpdater

PENDING = -1  # a token sampled by the step in flight, not yet on the host


def overlap_enabled(config: EngineConfig) -> bool:
    """Overlap is asked for and possible: with tensor parallelism the workers receive step
    inputs from the host buffers, where pending tokens are not, so it is off there."""
    return config.overlap_steps and config.tensor_parallel_size == 1


def known_tokens(req: Request) -> int:
    """How many of the request's tokens are on the host (placeholders are always last)."""
    n = len(req.token_ids)
    while n and req.token_ids[n - 1] == PENDING:
        n -= 1
    return n


@dataclass
class InflightStep:
    batch: ScheduledBatch
    launched: LaunchedStep
    placeholders: list[int]  # per sampled row: its placeholder's index in the row's token_ids
    computed: list[int]  # per batch request: its computed tokens once this step has run
    held: set[Request]  # sampling requests the next schedule holds (see the module doc)
    needs_host: bool  # the next step must wait for this one's tokens (forks, penalties)
    admitted: list[Request] = field(default_factory=list)  # from the queue, by this schedule
    first_admitted: list[Request] = field(default_factory=list)  # ... for the first time
    preempted: bool = False  # this step's schedule preempted a request: it cannot be undone


class Engine(Protocol):
    """What the overlapped loop uses of LLMEngine: its parts, and the plain loop's steps."""

    runner: ModelRunner
    scheduler: Scheduler
    pool: PagePool
    updater: WeightUpdater
    sleeper: Sleeper
    pending: list[RequestOutput]
    prompt_tokens_computed: int

    def _schedule(self, hold: Collection[Request] = ()) -> ScheduledBatch: ...
    def _advance(self, batch: ScheduledBatch) -> None: ...
    def _publish(self, reqs: list[Request], computed: list[int]) -> None: ...
    def _append_sampled(self, sampled: Sampled, first: list[RequestOutput]) -> StepOutputs: ...


class OverlappedSteps:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inflight: InflightStep | None = None
        engine.runner.enable_overlap()

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def step(self) -> Sequence[RequestOutput]:
        """Launch the next step, then collect the one in flight; return what changed (outputs
        made outside the steps first: aborts, errors)."""
        engine = self.engine
        drained = list(self.drain()) if self._must_collect_first() else []
        previous = self.inflight
        scheduler = engine.scheduler
        waiting, preemptions = set(scheduler.waiting), scheduler.num_preemptions
        first = {req for req in waiting if req.first_scheduled_time is None}
        batch = engine._schedule(hold=previous.held if previous is not None else ())
        self.inflight = None
        if batch:
            launched = self.inflight = self._launch(batch, previous)
            if waiting:  # for rewind(): what this schedule did to the queue
                launched.admitted = [req for req in batch.requests if req in waiting]
                launched.first_admitted = [req for req in launched.admitted if req in first]
            launched.preempted = scheduler.num_preemptions != preemptions
        # The step collected first is older than what this schedule ended (a request too big).
        ahead, engine.pending = drained + engine.pending, []  # then aborts and errors
        return ahead if previous is None else self._collect(previous, ahead)

    def drain(self) -> Sequence[RequestOutput]:
        """Collect the step in flight, if any: afterwards nothing runs on the device."""
        previous, self.inflight = self.inflight, None
        return self._collect(previous, []) if previous is not None else []

    def rewind(self) -> Sequence[RequestOutput]:
        """Undo the step in flight, as if it had not been launched: it runs to its end, its
        samples are dropped, its requests go back to their tokens and progress before it (those
        it admitted back to the queue); the KV it wrote is recomputed later. A weight update
        calls this, so that it lands at the step boundary a plain loop would have: after the
        last step whose tokens went out. A step whose schedule preempted a request cannot be
        undone: it is collected instead, and the update lands one step later."""
        step, self.inflight = self.inflight, None
        if step is None:
            return []
        if step.preempted:
            return self._collect(step, [])
        engine, scheduler = self.engine, self.engine.scheduler
        engine.runner.collect(step.launched)  # the device is idle afterwards
        for req, index in zip(step.launched.sampling, step.placeholders, strict=True):
            del req.token_ids[index:]  # (no-op for a request that ended meanwhile)
        for req, num_tokens in zip(step.batch.requests, step.batch.query_lens, strict=True):
            if not req.is_finished:
                if req.num_computed_tokens <= req.prompt_len:
                    engine.prompt_tokens_computed -= num_tokens
                req.num_computed_tokens -= num_tokens
        for req in step.admitted:
            if req.status is RequestStatus.RUNNING:
                scheduler.preempt(req)  # back to the queue, pages released
                scheduler.num_preemptions -= 1
        for req in step.first_admitted:  # its next admission counts as its first
            if not req.is_finished:
                req.first_scheduled_time = None
                scheduler.prefix_queries -= req.prompt_len
                scheduler.prefix_hits -= req.num_cached_tokens
                req.num_cached_tokens = 0
        return []

    def _must_collect_first(self) -> bool:
        step = self.inflight
        admin = self.engine.updater.in_progress or self.engine.sleeper.in_progress
        return step is not None and (step.needs_host or admin)

    def _launch(self, batch: ScheduledBatch, previous: InflightStep | None) -> InflightStep:
        engine = self.engine
        launched = engine.runner.launch(batch, _pending_inputs(batch, previous))
        engine._advance(batch)
        pool = engine.pool
        capacity = pool.num_pages * pool.page_size  # tokens the whole pool holds
        placeholders, held, needs_host = [], set(), False
        for req in launched.sampling:
            tokens = req.token_ids
            placeholders.append(len(tokens))
            tokens.append(PENDING)
            # Held: it ends at this token for sure, or its next token would not fit the pool.
            if len(tokens) - req.prompt_len >= req.max_tokens or len(tokens) + 1 > capacity:
                held.add(req)
            if req.status is RequestStatus.FORK_PENDING or reads_history(req):
                needs_host = True
        computed = [req.num_computed_tokens for req in batch.requests]
        return InflightStep(batch, launched, placeholders, computed, held, needs_host)

    def _collect(self, step: InflightStep, first: list[RequestOutput]) -> StepOutputs:
        """Bring step N's tokens to the host and postprocess them as the plain loop would:
        the placeholders of N+1 are set aside meanwhile, so stop checks, counts and outputs
        see exactly the tokens up to N. Returns `first`, then one output per kept row."""
        engine = self.engine
        sampled = engine.runner.collect(step.launched)
        keep = [row for row, req in enumerate(sampled.requests) if not req.is_finished]
        later = []  # per kept row: placeholders of the step launched after this one
        for row in keep:
            tokens, index = sampled.requests[row].token_ids, step.placeholders[row]
            later.append(len(tokens) - index - 1)
            del tokens[index:]
        engine._publish(step.batch.requests, step.computed)
        kept = sampled.rows(keep)
        outputs = engine._append_sampled(kept, first)
        for req, count in zip(kept.requests, later, strict=True):
            if count and not req.is_finished:
                req.token_ids += [PENDING] * count
        return outputs


def _pending_inputs(batch: ScheduledBatch, previous: InflightStep | None) -> PendingInputs | None:
    """Where the batch's input tokens are placeholders of the step in flight."""
    if previous is None:
        return None
    sampled_row = {req: row for row, req in enumerate(previous.launched.sampling)}
    positions: list[int] = []
    rows: list[int] = []
    start = 0  # the request's first token in the packed input
    for req, num_tokens in zip(batch.requests, batch.query_lens, strict=True):
        row = sampled_row.get(req)
        if row is not None:
            index = previous.placeholders[row] - req.num_computed_tokens
            if 0 <= index < num_tokens:
                positions.append(start + index)
                rows.append(row)
        start += num_tokens
    return PendingInputs(previous.launched, positions, rows) if positions else None
