"""When speculation turns itself off: above --speculative-max-batch decoding requests, for a
request whose proposals keep failing (it backs off), and for a request that opts out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine import SamplingParams
from engine.speculative.acceptance import MAX_SHIFT
from tests.support.overlap_runs import Request, make_engine, run
from tests.support.spec_runs import ReplayProposer, assert_same, spec_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def reqs(count: int, params: SamplingParams = GREEDY) -> list[Request]:
    """Staggered lengths: they end one by one."""
    return [
        Request(
            f"r{i}", [0, 3 + i, 7, 11 + i], replace(params, max_tokens=params.max_tokens - 6 * i)
        )
        for i in range(count)
    ]


def test_no_request_speculates_in_a_step_above_the_max_batch(tiny_llama: Path) -> None:
    plain = run(make_engine(tiny_llama, False), reqs(5))
    proposer = ReplayProposer(plain, 0.0)
    engine = spec_engine(tiny_llama, proposer, max_batch=4)
    assert_same(run(engine, reqs(5)), plain)
    # Five run together (asked nothing) until the shortest ends; then four are asked.
    assert proposer.calls and max(proposer.calls) <= 4
    assert engine.stats().spec_accepted_tokens > 0


def test_a_request_whose_proposals_keep_failing_backs_off(tiny_llama: Path) -> None:
    plain = run(make_engine(tiny_llama, False), reqs(1))
    proposer = ReplayProposer(plain, 1.0)  # every proposal wrong
    engine = spec_engine(tiny_llama, proposer)
    assert_same(run(engine, reqs(1)), plain)
    # 40 tokens, each verification emits one: without backing off it would be asked at
    # every decode step (39); backing off 1, 2, 4, 8 ... steps asks it about log2 times.
    asked = len(proposer.calls)
    assert 3 <= asked <= 3 + MAX_SHIFT


def test_a_request_that_opts_out_is_never_proposed_for(tiny_llama: Path) -> None:
    opted = [Request("out", [0, 5, 6, 7], replace(GREEDY, speculative=False))]
    plain = run(make_engine(tiny_llama, False), opted + reqs(2))
    proposer = ReplayProposer(plain, 0.0)
    engine = spec_engine(tiny_llama, proposer)
    asked: list[str] = []
    propose = proposer.propose
    proposer.propose = lambda rs, limits: (
        asked.extend(r.request_id for r in rs),
        propose(rs, limits),
    )[1]  # type: ignore[method-assign]
    spec = run(engine, opted + reqs(2))
    assert_same(spec, plain)
    assert "out" not in asked and {"r0", "r1"} <= set(asked)
