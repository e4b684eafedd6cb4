"""How requests start, and how they end outside a step's samples.

In: a request that engine/protocol/validation/request_rules.py refuses ends at once with ERROR (one output per
index), one that arrives while the engine sleeps (or drains into sleep) with ABORTED. One with a
structured-output constraint whose grammar is still compiling waits outside the scheduler
(engine/structured/structured_outputs.py) and starts once it is compiled; a constraint that did
not compile ends it with ERROR. Out, at a step's start: requests past their deadline, and those
the scheduler found too big for the whole KV cache. LLMEngine owns the requests and calls these
through `Engine`.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from engine.kv_cache.page_pool import PagePool
from engine.kv_cache.prefix_cache import PrefixCache
from engine.lora.registry import AdapterRegistry
from engine.models.hf_config import ModelConfig
from engine.overlap import known_tokens
from engine.postprocess import end_scored
from engine.protocol.config import EngineConfig
from engine.protocol.messages import FinishReason, RequestOutput, SamplingParams
from engine.protocol.validation.request_rules import RequestLimits, request_error
from engine.request_outputs import error_output, request_output
from engine.scheduling.request import Request, RequestStatus, new_sequences
from engine.scheduling.scheduler import Scheduler
from engine.sleep.sleeper import Sleeper
from engine.structured.request_grammar import RequestGrammar
from engine.structured.structured_outputs import Deferred, StructuredOutputs, grammar_error


class Engine(Protocol):
    """What admission uses of LLMEngine."""

    config: EngineConfig
    model_config: ModelConfig
    scheduler: Scheduler
    cache: PrefixCache
    pool: PagePool
    sleeper: Sleeper
    structured: StructuredOutputs
    lora: AdapterRegistry
    requests: dict[str, list[Request]]
    pending: list[RequestOutput]
    tokens_generated: int
    _rng: random.Random
    _arrivals: itertools.count[int]

    @property
    def policy_version(self) -> int: ...
    def finish(self, req: Request, reason: FinishReason, message: str | None) -> None: ...
    def abort(
        self, request_ids: Sequence[str], reason: FinishReason, message: str | None = None
    ) -> int: ...


def add_request(
    engine: Engine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    n: int,
    priority: int,
    deadline: float | None,
    min_policy_version: int | None,
) -> None:
    """LLMEngine.add_request, past the duplicate check."""
    version = engine.lora.version_of(params.adapter) if params.adapter else None
    model, version = engine.model_config, version or engine.policy_version
    limits = RequestLimits(
        model.vocab_size, model.max_model_len, engine.config.max_num_seqs, model.moe is not None
    )
    error = request_error(
        prompt, params, n, min_policy_version, limits, version, engine.lora.loaded
    )
    refused = error or engine.sleeper.refusing
    if refused is not None:
        reason = FinishReason.ERROR if error is not None else FinishReason.ABORTED
        refuse(engine, request_id, n, len(prompt), refused, reason)
        return
    begin = functools.partial(start, engine, request_id, prompt, params, n, priority, deadline)
    if params.structured is None:
        begin()
        return
    grammar = engine.structured.grammars.compile(params.structured)
    if grammar.done():
        begin(grammar)
    else:
        resume = functools.partial(begin, grammar)
        deferred = Deferred(grammar, resume, n, len(prompt), params.structured)
        engine.structured.defer(request_id, deferred)


def start(
    engine: Engine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    n: int,
    priority: int,
    deadline: float | None,
    grammar: Future[Any] | None = None,
) -> None:
    """Queue a valid request (each sample with a matcher of its compiled grammar, if it has a
    constraint)."""
    if grammar is not None and (failed := grammar_error(grammar)) is not None:
        refuse(engine, request_id, n, len(prompt), failed[1], FinishReason.ERROR)
        return
    adapter, version = engine.lora.key_of(params.adapter), engine.lora.version_of(params.adapter)
    if adapter is None:  # unloaded while its grammar compiled
        message = f"adapter: {params.adapter!r} is not loaded"
        refuse(engine, request_id, n, len(prompt), message, FinishReason.ERROR)
        return
    max_tokens = engine.model_config.max_model_len - len(prompt)
    if params.max_tokens is not None:
        max_tokens = min(max_tokens, params.max_tokens)
    seeds = [
        params.seed + index if params.seed is not None else engine._rng.getrandbits(64)
        for index in range(n)
    ]
    when = (priority, deadline)
    seqs = new_sequences(request_id, prompt, params, max_tokens, seeds, engine._arrivals, *when)
    for seq in seqs:
        seq.adapter_key, seq.adapter_version = adapter, version or 0
        if grammar is not None:
            seq.grammar = RequestGrammar(grammar.result())
    leader = seqs[0]
    engine.scheduler.add(leader)  # its siblings fork from its prompt's KV
    engine.requests[request_id] = seqs
    if max_tokens == 0 and leader.prompt_scores and leader.prompt_scores.complete:
        end_scored(engine, leader, engine.pending)  # nothing to score, nothing to generate


def refuse(
    engine: Engine,
    request_id: str,
    n: int,
    prompt_len: int,
    message: str | None,
    reason: FinishReason,
) -> None:
    """End a request that has no sequences: one output per index."""
    version = engine.policy_version
    engine.pending += [
        error_output(request_id, index, prompt_len, message, version, reason)
        for index in range(max(n, 1))
    ]


def expire_deadlines(engine: Engine) -> None:
    now = time.time()
    expired = [
        req_id
        for req_id, seqs in engine.requests.items()
        if seqs[0].deadline is not None and seqs[0].deadline <= now
    ]
    if expired:
        engine.abort(expired, FinishReason.DEADLINE_EXCEEDED, "the deadline passed")


def end_too_big(engine: Engine) -> None:
    """End the requests the scheduler found too big for the whole cache."""
    pool = engine.pool
    for req in engine.scheduler.too_big:
        need = pool.pages_for(req.num_tokens + 1)
        message = f"the request needs {need} KV pages but the whole cache has {pool.num_pages}"
        # Pending siblings go to the queue on their own and end the same way next step.
        engine.finish(req, FinishReason.ERROR, message)
        engine.pending.append(request_output(req, [], None, None, engine.policy_version))
    engine.scheduler.too_big.clear()


def finish(engine: Engine, req: Request, reason: FinishReason, message: str | None) -> None:
    """End `req` now: its pages go back to the pool, its pending siblings start on their own."""
    del req.token_ids[known_tokens(req) :]  # ended with a token in flight: it is dropped
    if req.status is not RequestStatus.FINISHED:  # the scheduler ends requests too big to fit
        engine.scheduler.remove(req, leader=engine.requests[req.request_id][0])
    for sibling in req.pending_forks:  # a leader ended early: they compute the prompt alone
        engine.scheduler.add(sibling)
    req.pending_forks = []
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason
    req.error = message
    req.finish_time = time.monotonic()
    seqs = engine.requests.get(req.request_id, [])
    if all(s.is_finished for s in seqs):
        engine.requests.pop(req.request_id, None)
