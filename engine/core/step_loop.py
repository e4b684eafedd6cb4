"""StepLoop: schedule, launch, collect, postprocess; the plain loop and the overlapped one.

`normal_step` schedules a batch, runs it and postprocesses its samples. `overlap_step` (with
`overlap_steps`) launches step N+1 before it collects step N: while the device computes N, the
host schedules N+1 and writes its inputs. Both use the same verbs: `schedule` (step-boundary
work first: deadlines, a pending weight swap or sleep, grammars compiled), `launch`, `collect`
and `postprocess` (the Postprocessor: engine/core/postprocess.py).

A token sampled at N is needed on the host only where it changes the schedule, so until N is
collected every request that samples at N counts it in `Request.num_pending`:
- the scheduler sees a request with one token left to compute and schedules it as a decode;
  its input id is read on the device from N's sampled ids (engine/execution/launched_step.py);
- the sampler's noise counter (the request's length) counts it, so a seeded request draws the
  same noise as in the plain loop;
- collecting N appends the token as the plain loop would (stop checks, outputs, prefix-cache
  publishing of pages whose tokens are all known); N+1's pending token stays counted. A request
  that ended at N (stop token, length, abort, deadline) has its N+1 row discarded; its pages
  were freed when it ended (the device reads them in order, before any later step that reuses
  them).
Requests whose pending token may end them in a way that changes the schedule are held out of
N+1: those that reach max_tokens (they end for sure) and those whose next page would not fit in
the whole pool (the plain loop ends them with ERROR unless the token stops them first).

Some steps are not overlapped: step N is collected before N+1 is scheduled while a weight
update or a sleep is in progress (a swap, or freeing the KV pool, needs nothing in flight),
when N sampled the first tokens of n > 1 siblings (forking copies KV pages on the host's side),
and when a request sampled at N uses penalties, bad words of two or more tokens or a
structured-output grammar (the sampler reads its tokens on the host: its history, or its
grammar's state after N's token). N+1's grammar mask is then computed while N+1's forward runs.

`settle` empties the loop before a weight swap: the step in flight is given back, as if it had
not been launched (its samples dropped, its requests' progress as recorded before it, those it
admitted back in the queue), so the swap lands where the plain loop lands it. Nothing counted
needs undoing: a step's prompt tokens and prefix-cache lookups are counted when it is
postprocessed. A step whose schedule preempted a request cannot be given back: it is collected.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from engine.core.output_columns import OutputColumns
from engine.core.postprocess import Postprocessor
from engine.core.request_table import RequestTable
from engine.execution.launched_step import LaunchedStep, PendingInputs, Sampled
from engine.execution.model_runner import ModelRunner
from engine.kv_cache.page_pool import PagePool
from engine.protocol.config import EngineConfig
from engine.protocol.messages import EngineStats, RequestOutput
from engine.sampling.sampling_slots import reads_history
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import ScheduledBatch, Scheduler
from engine.sleep.sleeper import Sleeper
from engine.speculative.verify import SpecDecoder
from engine.structured.structured_outputs import StructuredOutputs
from engine.weights.weight_updater import WeightUpdater


def overlap_enabled(config: EngineConfig) -> bool:
    """Overlap is asked for and possible: with tensor parallelism the workers receive step
    inputs from the host buffers, where pending tokens are not, so it is off there."""
    return config.overlap_steps and config.tensor_parallel_size == 1


@dataclass
class InflightStep:
    """A launched step the overlapped loop has not collected yet."""

    batch: ScheduledBatch
    launched: LaunchedStep
    positions: list[int]  # per sampled row: the position of the token it samples
    computed: list[int]  # per batch request: its computed tokens once this step has run
    prompt_tokens: int  # prompt tokens this step computes (counted when it is collected)
    held: set[Request]  # sampling requests the next schedule holds (see the module doc)
    needs_host: bool  # the next step must wait for this one's tokens (forks, penalties)
    preempted: bool  # its schedule preempted a request: it cannot be given back


class StepLoop:
    def __init__(
        self,
        table: RequestTable,
        scheduler: Scheduler,
        runner: ModelRunner,
        postprocessor: Postprocessor,
        admin: tuple[WeightUpdater, Sleeper, StructuredOutputs],
        overlapped: bool,
    ) -> None:
        self.table = table
        self.scheduler = scheduler
        self.runner = runner
        self.postprocessor = postprocessor
        self.updater, self.sleeper, self.structured = admin
        self.overlapped = overlapped
        self.inflight: InflightStep | None = None  # the overlapped loop's launched step
        self.prompt_tokens_computed = 0  # prompt tokens run through the model, ever
        self.spec: SpecDecoder | None = None  # speculative decoding, when on
        if overlapped:
            runner.enable_overlap()

    def speculate(self, spec: SpecDecoder) -> None:
        """Speculative decoding from now on (engine/speculative/verify.py)."""
        self.spec = spec
        self.scheduler.speculative = True
        self.table.on_finish = spec.finished

    @property
    def busy(self) -> bool:
        """A launched step is still to be collected."""
        return self.inflight is not None

    def step(self) -> Sequence[RequestOutput]:
        """One step of the loop in use; what changed (outputs made outside the step first)."""
        return self.overlap_step() if self.overlapped else self.normal_step()

    def stats(self) -> EngineStats:
        """What the engine reports of its requests, pages, steps and admin state."""
        scheduler, cache = self.scheduler, self.scheduler.cache
        lora = scheduler.adapter_gate is not None  # LoRA is on: name the requests' adapters
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + len(self.structured.deferred),
            total_pages=cache.pool.num_pages,
            free_pages=cache.pool.num_free,
            cached_pages=cache.num_cached,
            policy_version=scheduler.policy_version,
            prompt_tokens_computed=self.prompt_tokens_computed,
            tokens_generated=self.postprocessor.tokens_generated,
            prefix_cache_queries=scheduler.prefix_queries,
            prefix_cache_hits=scheduler.prefix_hits,
            preemptions=scheduler.num_preemptions,
            spec_proposed_tokens=self.spec.proposed_tokens if self.spec else 0,
            spec_accepted_tokens=self.spec.accepted_tokens if self.spec else 0,
            updating_weights=self.updater.in_progress,
            sleep_level=self.sleeper.level,
            running_adapters=_adapters(scheduler.running) if lora else (),
            waiting_adapters=_adapters(scheduler.waiting) if lora else (),
        )

    def reset_counts(self) -> None:
        """Zero what the stats count of the steps run so far (after the start-up warm-up)."""
        scheduler = self.scheduler
        scheduler.prefix_queries = scheduler.prefix_hits = scheduler.num_preemptions = 0
        self.prompt_tokens_computed = self.postprocessor.tokens_generated = 0
        if self.spec is not None:
            self.spec.proposed_tokens = self.spec.accepted_tokens = 0

    # ---- the two loops ----

    def normal_step(self) -> Sequence[RequestOutput]:
        """Schedule, run, postprocess."""
        batch = self.schedule()
        first = self.table.take_outputs()  # ended outside the batch: aborts, errors
        if not batch:
            return first
        sampled = self.runner.run(batch)
        computed, prompt_tokens = self.advance(batch)
        return self.postprocess(batch, sampled, computed, prompt_tokens, first)

    def overlap_step(self) -> Sequence[RequestOutput]:
        """Launch the next step, then collect the one in flight."""
        drained = list(self.drain()) if self._must_collect_first() else []
        previous, self.inflight = self.inflight, None
        if previous is None:
            batch = self.schedule()
        else:  # nothing to propose from: its requests' last tokens are still being sampled
            batch = self.schedule(previous.held, speculate=False)
        if batch:
            self.inflight = self.launch(batch, previous)
        # The step collected first is older than what this schedule ended (a request too big).
        ahead = drained + self.table.take_outputs()  # then aborts and errors
        return ahead if previous is None else self.collect(previous, ahead)

    def drain(self) -> Sequence[RequestOutput]:
        """Collect the step in flight, if any: afterwards nothing runs on the device."""
        previous, self.inflight = self.inflight, None
        return self.collect(previous, []) if previous is not None else []

    def settle(self) -> None:
        """Nothing in flight (a weight swap needs it): the step in flight is given back, so
        the swap lands where the plain loop's would; one whose schedule preempted is collected
        instead (the swap lands one step later). Outputs go to the table's pending outputs."""
        step, self.inflight = self.inflight, None
        if step is None:
            return
        if step.preempted:
            self.table.pending += list(self.collect(step, []))
            return
        self.runner.collect(step.launched)  # its samples are dropped; the device is idle
        batch = step.batch
        for req in step.launched.sampling:
            req.num_pending = 0  # (this step's token: the one before it was collected)
        for req, done, num_tokens in zip(
            batch.requests, step.computed, batch.query_lens, strict=True
        ):
            if not req.is_finished:
                req.num_computed_tokens = done - num_tokens  # its progress before the step
        for req in batch.admitted:
            if req.status is RequestStatus.RUNNING:
                self.scheduler.requeue(req)  # pages released; the KV is computed again later
        for req in batch.first_admitted:  # its next admission counts as its first
            if not req.is_finished:
                req.first_scheduled_time = None
                req.num_cached_tokens = 0
        if self.spec is not None:
            self.spec.given_back(batch)

    # ---- the verbs ----

    def schedule(self, hold: Collection[Request] = (), speculate: bool = True) -> ScheduledBatch:
        """Step-boundary work (deadlines, a pending weight swap or sleep, grammars compiled),
        then the next batch (`hold`: requests that sit it out; drafts to verify only when
        `speculate`: with nothing in flight)."""
        self.table.expire()
        self.updater.advance()
        self.sleeper.advance()
        self.structured.start_ready()
        spec = self.spec
        if spec is not None and speculate:
            spec.propose(self.scheduler.running, hold, self.scheduler.policy_version)
        batch = self.scheduler.schedule(hold)
        if spec is not None:
            spec.scheduled(batch)
        self.table.end_too_big()
        now = time.monotonic()
        for req in [r for r in batch.requests if r.first_scheduled_time is None]:
            req.first_scheduled_time = now
        return batch

    def advance(self, batch: ScheduledBatch) -> tuple[list[int], int]:
        """Count the batch's tokens as computed: (each request's computed tokens now, how many
        of the batch's tokens are prompt tokens)."""
        computed: list[int] = []
        prompt_tokens = 0
        for req, num_tokens in zip(batch.requests, batch.query_lens, strict=True):
            done = req.num_computed_tokens = req.num_computed_tokens + num_tokens
            computed.append(done)
            if done <= req.prompt_len:
                prompt_tokens += num_tokens
        return computed, prompt_tokens

    def launch(self, batch: ScheduledBatch, previous: InflightStep | None) -> InflightStep:
        """Enqueue the batch's forward and sampling; each sampling request counts its token as
        pending until the step is collected."""
        launched = self.runner.launch(batch, pending_inputs(batch, previous))
        computed, prompt_tokens = self.advance(batch)
        pool: PagePool = self.scheduler.cache.pool
        capacity = pool.logical_capacity * pool.page_size  # tokens one request surely fits
        positions, held, needs_host = [], set(), False
        for req in launched.sampling:
            positions.append(req.num_tokens)
            req.num_pending += 1
            length = req.num_tokens
            # Held: it ends at this token for sure, or its next token would not fit the pool.
            if length - req.prompt_len >= req.max_tokens or length + 1 > capacity:
                held.add(req)
            if req.status is RequestStatus.FORK_PENDING or reads_history(req):
                needs_host = True
        if self.spec is not None:  # it verifies drafts, or the next step may propose
            running = len(self.scheduler.running)
            needs_host = needs_host or bool(launched.verifying) or self.spec.wants_host(running)
        return InflightStep(
            batch, launched, positions, computed, prompt_tokens, held, needs_host, batch.preempted
        )

    def collect(self, step: InflightStep, first: list[RequestOutput]) -> OutputColumns:
        """Bring step N's tokens to the host and postprocess them as the plain loop would;
        the rows of requests that ended meanwhile are dropped. Returns `first`, then one
        output per kept row."""
        sampled = self.runner.collect(step.launched)
        keep = [row for row, req in enumerate(sampled.requests) if not req.is_finished]
        for row in keep:
            sampled.requests[row].num_pending -= 1  # it arrives: postprocessing appends it
        kept = sampled.rows(keep)
        return self.postprocess(step.batch, kept, step.computed, step.prompt_tokens, first)

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: Sampled,
        computed: list[int],
        prompt_tokens: int,
        first: list[RequestOutput],
    ) -> OutputColumns:
        """Count the step, publish its full pages to the prefix cache, append the sampled
        tokens; returns `first`, then one output per sampled row. A step that verified
        drafts appends its kept tokens in rounds, one token per request each
        (engine/speculative/verify.py)."""
        self.prompt_tokens_computed += prompt_tokens
        self.scheduler.count(batch)
        rounds = [sampled]
        if sampled.verifying:
            assert self.spec is not None
            rounds = self.spec.accept(sampled, batch, computed)
        self.postprocessor.publish_pages(batch.requests, computed)
        outputs = self.postprocessor.append_sampled(rounds[0], first)
        for later in rounds[1:]:  # without the requests an earlier round's token ended
            going = later.rows([row for row, r in enumerate(later.requests) if not r.is_finished])
            outputs = self.postprocessor.append_sampled(going, list(outputs))
        return outputs

    def _must_collect_first(self) -> bool:
        step = self.inflight
        admin = self.updater.in_progress or self.sleeper.in_progress
        return step is not None and (step.needs_host or admin)


def pending_inputs(batch: ScheduledBatch, previous: InflightStep | None) -> PendingInputs | None:
    """Where the batch's input tokens are the pending tokens of the step in flight."""
    if previous is None:
        return None
    sampled_row = {req: row for row, req in enumerate(previous.launched.sampling)}
    positions: list[int] = []
    rows: list[int] = []
    start = 0  # the request's first token in the packed input
    for req, num_tokens in zip(batch.requests, batch.query_lens, strict=True):
        row = sampled_row.get(req)
        if row is not None:
            index = previous.positions[row] - req.num_computed_tokens
            if 0 <= index < num_tokens:
                positions.append(start + index)
                rows.append(row)
        start += num_tokens
    return PendingInputs(previous.launched, positions, rows) if positions else None


def _adapters(requests: Iterable[Request]) -> tuple[str, ...]:
    """The distinct LoRA adapter names of `requests`, sorted."""
    return tuple(sorted({r.params.adapter for r in requests if r.params.adapter}))
