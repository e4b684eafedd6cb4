"""Joining a trainer's group happens beside the engine's steps: a store that accepts and never
answers (SilentListener) or nothing listening ends the join at its timeout, UNAVAILABLE, while
requests keep generating; joins still blocked in c10d are abandoned, a few at most."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.protocol.messages import InitWeightTransfer, TransferGroupSpec
from engine.weights.group_join import MAX_ABANDONED
from tests.support.silent_listener import SilentListener, refused_port

PROMPT = [0, 17, 42, 99, 123, 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SLACK_S = 1.0  # the loop answers at its next iteration after the deadline


@pytest.fixture(scope="module")
def one_rank(tiny_llama) -> Iterator[LLMEngine]:
    engine = make_engine(tiny_llama)
    yield engine
    engine.close()


@pytest.fixture
def two_ranks(tiny_llama) -> Iterator[LLMEngine]:
    engine = make_engine(tiny_llama, ranks=2)
    yield engine
    engine.close()


def make_engine(model: object, ranks: int = 1) -> LLMEngine:
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=ranks,
        cpu_threads=1,
        warmup=False,
    )
    return LLMEngine(config)


def spec(port: int, timeout: float, ranks: int = 1) -> TransferGroupSpec:
    return TransferGroupSpec("127.0.0.1", port, 1 + ranks, 1, "gloo", "g", timeout)


def wait_for(engine: LLMEngine, bound: float) -> tuple[object, float]:
    """Poll the engine as its loop does, stepping nothing: the answer and when it came."""
    started = time.monotonic()
    while (answer := engine.settle_weight_transfer()) is None:
        assert time.monotonic() - started < bound, "the join was not answered in time"
        joining = engine.updater.transfer.joining
        assert joining is not None
        joining.wait(min(0.05, joining.due_in()))
    return answer, time.monotonic() - started


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_store_that_never_answers_fails_the_join_at_its_timeout_while_requests_generate(
    request, ranks
) -> None:
    engine = request.getfixturevalue("one_rank" if ranks == 1 else "two_ranks")
    timeout = 3.0  # generating takes a fraction of it, even on a loaded machine
    expected = [r.token_ids for r in engine.generate([PROMPT], GREEDY)]
    with SilentListener() as listener:
        began = time.monotonic()
        assert (
            engine.begin_weight_transfer(
                InitWeightTransfer("j", spec(listener.port, timeout, ranks))
            )
            is None
        )
        assert listener.accepted.wait(10)  # the join is blocked in c10d now
        assert [r.token_ids for r in engine.generate([PROMPT], GREEDY)] == expected
        generated = time.monotonic() - began
        assert engine.settle_weight_transfer() is None  # still joining after generating
        answer, _ = wait_for(engine, timeout + SLACK_S)
        ended = time.monotonic() - began
    assert generated < timeout <= ended < timeout + SLACK_S
    assert answer.error_code == "UNAVAILABLE" and "within 3 s" in answer.message  # type: ignore[attr-defined]
    assert not engine.updater.transfer.joined
    assert [r.token_ids for r in engine.generate([PROMPT], GREEDY)] == expected


def test_nothing_listening_fails_the_join_at_its_timeout_not_twice_it(one_rank) -> None:
    engine = one_rank
    with refused_port() as port:
        began = time.monotonic()
        joined = engine.join_weight_transfer(InitWeightTransfer("j", spec(port, 1.0)))
        elapsed = time.monotonic() - began
    assert joined.error_code == "UNAVAILABLE" and 1.0 <= elapsed < 1.0 + SLACK_S, (joined, elapsed)


def test_joins_left_blocked_are_bounded_and_end_when_the_peer_hangs_up(one_rank) -> None:
    engine = one_rank
    for earlier in engine.updater.transfer._abandoned:  # other tests' listeners have closed
        earlier.wait(10)
    with SilentListener() as listener:
        for n in range(MAX_ABANDONED):
            joined = engine.join_weight_transfer(
                InitWeightTransfer(f"j{n}", spec(listener.port, 0.3))
            )
            assert joined.error_code == "UNAVAILABLE"
        began = time.monotonic()
        refused = engine.join_weight_transfer(InitWeightTransfer("more", spec(listener.port, 5.0)))
        assert refused.error_code == "UNAVAILABLE" and "still waiting" in refused.message
        assert time.monotonic() - began < 0.5  # refused at once, not after its timeout
        assert listener.connections == MAX_ABANDONED
        listener.close_connections()  # c10d's waits fail: the abandoned threads end
        abandoned = engine.updater.transfer._abandoned
        for joining in abandoned:
            joining.wait(10)
        assert not any(j.blocked for j in abandoned)
        again = engine.join_weight_transfer(InitWeightTransfer("again", spec(listener.port, 0.3)))
    assert "still waiting" not in again.message and again.error_code == "UNAVAILABLE"
