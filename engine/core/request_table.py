"""RequestTable: the requests in flight, and every way one starts or ends outside a step's samples.

It owns the requests (request id -> its n sequences), the outputs made outside a step (errors,
aborts, expiries: the next step returns them first), the rng that draws unseeded requests'
seeds and the arrival counter (FCFS order, and the ids of in-process calls).

In: a request that engine/protocol/validation/request_rules.py refuses ends at once with ERROR (one output per
index), one that arrives while the engine sleeps (or drains into sleep) with ABORTED. One with a
structured-output constraint whose grammar is still compiling waits outside the scheduler
(engine/structured/structured_outputs.py) and starts once it is compiled; a constraint that did
not compile ends it with ERROR. Out: `finish` is the one way a sequence ends; at a step's start,
`expire` ends the requests past their deadline and `end_too_big` those the scheduler found too
big for the whole KV cache; `abort` ends them on request.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from engine.core.request_output import error_output, request_output
from engine.kv_cache.page_pool import PagePool
from engine.lora.registry import AdapterRegistry
from engine.models.hf_config import ModelConfig
from engine.protocol.config import EngineConfig
from engine.protocol.messages import FinishReason, RequestOutput, SamplingParams
from engine.protocol.validation.request_rules import RequestLimits, request_error
from engine.scheduling.request import Request, RequestStatus, new_sequences
from engine.scheduling.scheduler import Scheduler
from engine.structured.request_grammar import RequestGrammar
from engine.structured.structured_outputs import Deferred, StructuredOutputs, grammar_error


class RequestTable:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        scheduler: Scheduler,
        pool: PagePool,
        lora: AdapterRegistry,
        structured: StructuredOutputs,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.scheduler = scheduler
        self.pool = pool
        self.lora = lora
        self.structured = structured
        self.requests: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.pending: list[RequestOutput] = []  # made outside a step: errors, aborts
        self.rng = random.Random(config.seed)  # unseeded requests' seeds
        self.arrivals = itertools.count()  # FCFS order; in-process calls' ids
        self.on_finish: Callable[[Request], None] | None = None  # told of each request ended

    @property
    def policy_version(self) -> int:
        """The served weights' version (the scheduler holds it: it hashes prefixes)."""
        return self.scheduler.policy_version

    def next_id(self, prefix: str) -> str:
        """A fresh id for an in-process call or request: `prefix-N`."""
        return f"{prefix}-{next(self.arrivals)}"

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs made outside the steps since the last call, oldest first."""
        outputs, self.pending = self.pending, []
        return outputs

    def request_ids(self) -> list[str]:
        """Every request in flight, those waiting for their grammar included."""
        return [*self.requests, *self.structured.deferred]

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        n: int,
        when: tuple[int, float | None, int | None],
        refusing: str | None,
    ) -> None:
        """Queue a request (`when`: priority, deadline, min_policy_version), or end it at once:
        ERROR when invalid, ABORTED with `refusing` (the engine sleeps) when that is set."""
        if request_id in self.requests or request_id in self.structured.deferred:
            raise ValueError(f"request id {request_id!r} is already in flight")
        priority, deadline, min_policy_version = when
        lora = self.lora
        version = lora.version_of(params.adapter) if params.adapter else None
        model, version = self.model_config, version or self.policy_version
        limits = RequestLimits(
            model.vocab_size, model.max_model_len, self.config.max_num_seqs, model.moe is not None
        )
        error = request_error(prompt, params, n, min_policy_version, limits, version, lora.loaded)
        refused = error or refusing
        if refused is not None:
            reason = FinishReason.ERROR if error is not None else FinishReason.ABORTED
            self.refuse(request_id, n, len(prompt), refused, reason)
            return
        begin = functools.partial(self.start, request_id, prompt, params, n, priority, deadline)
        if params.structured is None:
            begin()
            return
        grammar = self.structured.grammars.compile(params.structured)
        if grammar.done():
            begin(grammar)
        else:
            deferred = Deferred(
                grammar, functools.partial(begin, grammar), n, len(prompt), params.structured
            )
            self.structured.defer(request_id, deferred)

    def start(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        n: int,
        priority: int,
        deadline: float | None,
        grammar: Future[Any] | None = None,
    ) -> None:
        """Queue a valid request (each sample with a matcher of its compiled grammar, if it
        has a constraint)."""
        if grammar is not None and (failed := grammar_error(grammar)) is not None:
            self.refuse(request_id, n, len(prompt), failed[1], FinishReason.ERROR)
            return
        adapter, version = self.lora.key_of(params.adapter), self.lora.version_of(params.adapter)
        if adapter is None:  # unloaded while its grammar compiled
            message = f"adapter: {params.adapter!r} is not loaded"
            self.refuse(request_id, n, len(prompt), message, FinishReason.ERROR)
            return
        max_tokens = self.model_config.max_model_len - len(prompt)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        seeds = [
            params.seed + index if params.seed is not None else self.rng.getrandbits(64)
            for index in range(n)
        ]
        when = (priority, deadline)
        seqs = new_sequences(request_id, prompt, params, max_tokens, seeds, self.arrivals, *when)
        for seq in seqs:
            seq.adapter_key, seq.adapter_version = adapter, version or 0
            if grammar is not None:
                seq.grammar = RequestGrammar(grammar.result())
        leader = seqs[0]
        self.scheduler.add(leader)  # its siblings fork from its prompt's KV
        self.requests[request_id] = seqs
        if max_tokens == 0 and leader.prompt_scores and leader.prompt_scores.complete:
            self.end_scored(leader, self.pending)  # nothing to score, nothing to generate

    def refuse(
        self,
        request_id: str,
        n: int,
        prompt_len: int,
        message: str | None,
        reason: FinishReason,
    ) -> None:
        """End a request that has no sequences: one output per index."""
        version = self.policy_version
        self.pending += [
            error_output(request_id, index, prompt_len, message, version, reason)
            for index in range(max(n, 1))
        ]

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
                self.refuse(request_id, deferred.n, deferred.prompt_len, message, reason)
                ended += deferred.n
            for req in list(self.requests.get(request_id, [])):
                if not req.is_finished and index in (None, req.index):
                    self.end(req, reason, message, self.pending)
                    ended += 1
        return ended

    def expire(self) -> None:
        """End the requests whose deadline has passed (DEADLINE_EXCEEDED)."""
        now = time.time()
        expired = [
            req_id
            for req_id, seqs in self.requests.items()
            if seqs[0].deadline is not None and seqs[0].deadline <= now
        ]
        if expired:
            self.abort(expired, FinishReason.DEADLINE_EXCEEDED, "the deadline passed")

    def end_too_big(self) -> None:
        """End the requests the scheduler found too big for the whole cache."""
        pool, budget = self.pool, self.scheduler.max_num_batched_tokens
        for req in self.scheduler.too_big:
            need = self.scheduler.pages.peak(req.num_tokens + 1, budget)
            message = f"the request needs {need} KV pages but the whole cache has {pool.num_pages}"
            # Pending siblings go to the queue on their own and end the same way next step.
            self.end(req, FinishReason.ERROR, message, self.pending)
        self.scheduler.too_big.clear()

    def end(
        self, req: Request, reason: FinishReason, message: str | None, into: list[RequestOutput]
    ) -> None:
        """Finish `req` and append its final output (no new token) to `into`."""
        self.finish(req, reason, message)
        into.append(request_output(req, [], None, None, self.policy_version))

    def end_scored(self, req: Request, into: list[RequestOutput]) -> None:
        """A request that only scores its prompt (max_tokens 0) ends once it is scored."""
        scores, req.prompt_scores = req.prompt_scores, None
        assert scores is not None
        self.finish(req, FinishReason.LENGTH, None)
        out = request_output(req, [], None, None, self.policy_version)
        out.prompt_logprobs = scores.result()
        into.append(out)

    def finish(self, req: Request, reason: FinishReason, message: str | None) -> None:
        """End `req` now: its pages go back to the pool, its pending siblings start on their
        own; a token still being sampled for it is dropped."""
        req.num_pending = 0
        if req.status is not RequestStatus.FINISHED:  # the scheduler ends requests too big
            self.scheduler.remove(req, leader=self.requests[req.request_id][0])
        for sibling in req.pending_forks:  # a leader ended early: they compute the prompt alone
            self.scheduler.add(sibling)
        req.pending_forks = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = message
        req.finish_time = time.monotonic()
        if self.on_finish is not None:
            self.on_finish(req)
        seqs = self.requests.get(req.request_id, [])
        if all(s.is_finished for s in seqs):
            self.requests.pop(req.request_id, None)
