"""Compiles in worker processes, with real workers: a constraint past the time or memory limit
is refused naming its field while other callers' constraints compile; a compile nobody waits
for any more is dropped (queued) or killed (running).

The bomb: grammar_bomb.py's GBNF grammar, which xgrammar takes 35 s or more to compile on this
tokenizer, uninterruptibly."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xgrammar
from structlog.testing import capture_logs

from engine.models.hf_config import load_model_config
from engine.protocol.messages import Constraint
from engine.structured import compile_pool
from engine.structured.compile_pool import CompileLimits, CompilePool
from engine.structured.grammars import ConstraintError, Grammars, compile_with, tokenizer_info
from engine.structured.structured_outputs import Deferred, StructuredOutputs
from tests.support.grammar_bomb import BOMB_RULES, long_grammar, wide_grammar
from tests.support.server_process import wait_gone

START_S = 120.0  # workers import torch and xgrammar: seconds, more on a loaded machine


BOMB = Constraint("grammar", wide_grammar())
SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SMALL = Constraint("json_schema", json.dumps(SMALL_SCHEMA))


def make_grammars(model: Path, **limits: Any) -> Grammars:
    cfg = load_model_config(model, None)
    grammars = Grammars(model, cfg.vocab_size, cfg.eos_token_ids, CompileLimits(**limits))
    assert grammars.pool.wait_started(START_S)
    return grammars


@pytest.fixture
def two_workers(tiny_llama: Path) -> Iterator[Grammars]:
    grammars = make_grammars(tiny_llama, workers=2, timeout_s=2.0)
    yield grammars
    grammars.close()


def seconds_to_compile(grammars: Grammars, constraint: Constraint, caller: str) -> float:
    start = time.monotonic()
    grammars.compile(constraint, caller).result(timeout=60)
    return time.monotonic() - start


def test_a_bomb_is_refused_past_the_time_limit_and_another_callers_schema_compiles_meanwhile(
    two_workers: Grammars,
) -> None:
    start = time.monotonic()
    bomb = two_workers.compile(BOMB, "a")
    small_s = seconds_to_compile(two_workers, SMALL, "b")
    with pytest.raises(ConstraintError) as refused:
        bomb.result(timeout=60)
    bomb_s = time.monotonic() - start
    assert str(refused.value) == (
        "structured.grammar: too costly to compile: not compiled within 2 s"
    )
    assert 2.0 <= bomb_s < 30  # killed at the limit, not compiled (35 s)
    assert small_s < 2.0  # never behind the bomb
    compiled = two_workers.compile(SMALL).result()
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string('{"a": 1}') and matcher.is_completed()


def test_a_refused_bomb_sent_again_is_refused_at_once(two_workers: Grammars) -> None:
    with pytest.raises(ConstraintError):
        two_workers.compile(BOMB, "a").result(timeout=60)
    assert two_workers.compile(BOMB, "a").done()


def test_one_callers_second_bomb_waits_for_its_first_and_others_pass_both(
    two_workers: Grammars,
) -> None:
    first = two_workers.compile(BOMB, "a")
    second = two_workers.compile(Constraint("grammar", wide_grammar(BOMB_RULES + 1)), "a")
    assert seconds_to_compile(two_workers, SMALL, "b") < 2.0
    done, _ = concurrent.futures.wait([first, second], 60, concurrent.futures.FIRST_COMPLETED)
    assert done == {first}  # one worker for `a`: the second started after the first's end
    assert isinstance(second.exception(timeout=60), ConstraintError)


def test_a_compile_past_the_memory_limit_is_refused_naming_its_field(tiny_llama: Path) -> None:
    grammars = make_grammars(tiny_llama, workers=1, timeout_s=60.0, memory_bytes=64 << 20)
    try:
        assert grammars.compile(SMALL).exception(timeout=60) is None  # fits in 64 MiB
        with pytest.raises(ConstraintError) as refused:
            grammars.compile(Constraint("grammar", long_grammar())).result(timeout=60)
        assert str(refused.value) == (
            "structured.grammar: too costly to compile: needs more than 64 MiB"
        )
        # Its worker was replaced, and serves the next constraint.
        regex = grammars.compile(Constraint("regex", "[0-9]+")).result(timeout=START_S)
        assert xgrammar.GrammarMatcher(regex).accept_string("42")
    finally:
        grammars.close()


@pytest.fixture
def one_worker(tiny_llama: Path) -> Iterator[CompilePool]:
    cfg = load_model_config(tiny_llama, None)
    info = functools.partial(tokenizer_info, tiny_llama, cfg.vocab_size, cfg.eos_token_ids)
    pool = CompilePool(CompileLimits(workers=1, timeout_s=60.0), info, compile_with)
    assert pool.wait_started(START_S)
    yield pool
    pool.close()


def wait_running(pool: CompilePool, constraint: Constraint) -> Any:
    """Submit `constraint` and return its job once a worker compiles it."""
    job = pool.submit(constraint, "a")
    end = time.monotonic() + 10
    while job.slot is None:
        assert time.monotonic() < end, "the job was never taken"
        time.sleep(0.01)
    return job


def test_an_abandoned_running_compile_is_cancelled_and_its_worker_killed(
    one_worker: CompilePool,
) -> None:
    job = wait_running(one_worker, BOMB)
    pid = one_worker.slots[0].process.pid
    start = time.monotonic()
    one_worker.abandon(job)
    assert wait_gone(pid, 5.0)
    concurrent.futures.wait([job.future], 5.0)
    assert job.future.cancelled()
    assert time.monotonic() - start < 5.0  # not the bomb's 35 s, nor the 60 s limit
    small = one_worker.submit(SMALL, "b")  # a fresh worker serves the next one
    assert small.future.exception(timeout=START_S) is None


def test_an_abandoned_queued_compile_is_dropped_without_running(one_worker: CompilePool) -> None:
    running = wait_running(one_worker, BOMB)
    queued = one_worker.submit(SMALL, "a")  # behind `a`'s own bomb
    one_worker.abandon(queued)
    assert queued.future.cancelled() and queued.slot is None
    one_worker.abandon(running)


def test_a_compile_is_cancelled_only_when_its_last_waiter_leaves(tiny_llama: Path) -> None:
    grammars = make_grammars(tiny_llama, workers=1, timeout_s=60.0)
    outputs = StructuredOutputs(grammars)
    try:
        outputs.check("check", BOMB, "a")
        future = grammars.compile(BOMB)  # a request waits on the same compile
        outputs.defer("request", Deferred(future, lambda: None, 1, 3, BOMB))
        outputs.abandon_check("check")
        assert not future.done()  # the request still waits
        assert outputs.drop("request") is not None  # aborted: nobody waits any more
        concurrent.futures.wait([future], 10.0)
        assert future.cancelled()
        assert outputs.verdicts() == []  # an abandoned check is never answered
    finally:
        grammars.close()


def exit_before_reading(conn: Any, *args: Any) -> None:
    """A compile worker that dies before it reads the TokenizerInfo the engine sends it."""
    os._exit(3)


def test_a_worker_that_dies_at_start_fails_its_jobs_saying_so(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's send or receive then meets a reset pipe (a socket pair), not an EOF: that
    # must read as a worker that did not start, never as a ConnectionResetError of its own.
    monkeypatch.setattr(compile_pool, "worker_main", exit_before_reading)
    with capture_logs() as logs:
        grammars = make_grammars(tiny_llama, workers=1)
        try:
            with pytest.raises(RuntimeError, match="did not start"):
                grammars.compile(SMALL, "a").result(timeout=60)
        finally:
            grammars.close()
    failures = [e["error"] for e in logs if e["event"] == "engine.grammar_worker_failed"]
    assert failures and all("did not start" in error for error in failures)
