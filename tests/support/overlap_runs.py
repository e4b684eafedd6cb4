"""Builders for the overlap tests: the same requests through a plain and an overlapped engine,
and what each request's client saw."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.protocol.messages import RequestOutput


def make_engine(checkpoint: Path, overlap: bool, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint), device="cpu", dtype="float32", overlap_steps=overlap, **overrides
    )
    return LLMEngine(config)


@dataclass
class Seen:
    """Everything one sequence's client received, in order."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    n: int = 1


OnOutput = Callable[[LLMEngine, RequestOutput, dict[tuple[str, int], Seen]], None]


def run(
    engine: LLMEngine, requests: Sequence[Request], on_output: OnOutput | None = None
) -> dict[tuple[str, int], Seen]:
    """Add the requests, step until the engine is idle; `on_output` may act between steps
    (cancel, update weights, add requests) after seeing each output."""
    for r in requests:
        engine.add_request(r.request_id, r.prompt, r.params, n=r.n)
    seen: dict[tuple[str, int], Seen] = {}
    while engine.has_work():
        for out in engine.step():
            s = seen.setdefault((out.request_id, out.index), Seen())
            assert s.finish_reason is None, f"an output after the final one: {out}"
            s.token_ids += out.new_token_ids
            s.logprobs += out.logprobs or []
            s.top += out.top_logprobs or []
            s.versions += [out.policy_version] * len(out.new_token_ids)
            s.finish_reason = out.finish_reason
            s.completion_tokens = out.completion_tokens
            s.cached_tokens = out.cached_tokens
            if on_output is not None:
                on_output(engine, out, seen)
    assert all(s.finish_reason is not None for s in seen.values())
    return seen


def both(
    checkpoint: Path,
    requests: Sequence[Request],
    on_output: OnOutput | None = None,
    **overrides: object,
) -> tuple[dict[tuple[str, int], Seen], dict[tuple[str, int], Seen], LLMEngine]:
    """(plain results, overlapped results, the overlapped engine)."""
    reference = make_engine(checkpoint, False, **overrides)  # alive to the end: hooks key on id()
    plain = run(reference, requests, on_output)
    engine = make_engine(checkpoint, True, **overrides)
    assert engine.overlap is not None
    return plain, run(engine, requests, on_output), engine


def assert_all_pages_returned(engine: LLMEngine) -> None:
    pool = engine.pool
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.overlap is None or engine.overlap.inflight is None
    assert all(count == 0 for count in pool.ref_counts)
    assert pool.num_free + engine.cache.num_cached == pool.num_pages
    table = engine.scheduler.block_table  # every slot back on the free list, emptied
    assert sorted(table.free) == list(range(table.num_slots))
    assert not table.num_pages.any()


def assert_block_table_matches(engine: LLMEngine) -> None:
    """Each request holding pages holds a slot whose row is its pages; no other slot is held."""
    scheduler = engine.scheduler
    table = scheduler.block_table
    reqs = scheduler.running + scheduler.waiting
    for req in reqs:
        if req.pages:
            assert req.slot is not None and table.row(req) == req.pages, f"{req.key}: stale row"
        else:
            assert req.slot is None, f"{req.key} holds slot {req.slot} without pages"
    held = [req.slot for req in reqs if req.pages]
    assert len(set(held)) == len(held) and not set(held) & set(table.free)
    assert len(table.free) + len(held) == table.num_slots, "a slot leaked"


def when(request_id: str, tokens: int, action: Any) -> Any:
    """An on_output hook: `action(engine)` once `request_id`'s client has seen `tokens`
    (once per engine)."""
    done: set[int] = set()

    def hook(engine: LLMEngine, out: RequestOutput, seen: dict[tuple[str, int], Seen]) -> None:
        if id(engine) in done or out.request_id != request_id:
            return
        if len(seen[(request_id, out.index)].token_ids) >= tokens:
            done.add(id(engine))
            action(engine)

    return hook
