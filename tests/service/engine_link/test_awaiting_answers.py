"""AwaitingAnswers: what waits for the engine's answer, by id, and what a lost engine answers."""

from __future__ import annotations

import pytest

from service.engine_link.awaiting_answers import AwaitingAnswers


def lost(answer_id: str, message: str) -> str:
    return f"lost {answer_id}: {message}"


async def test_an_answer_resolves_the_future_of_its_id_only() -> None:
    waiting: AwaitingAnswers[str] = AwaitingAnswers(lost)
    a, b = waiting.expect("a"), waiting.expect("b")
    assert waiting.route("a", "yes") and len(waiting) == 1
    assert a.result() == "yes" and not b.done()
    assert not waiting.route("a", "again")  # answered once: nothing waits for it any more


async def test_an_answer_nobody_waits_for_is_refused() -> None:
    waiting: AwaitingAnswers[str] = AwaitingAnswers(lost)
    waiting.expect("gone")
    waiting.discard("gone")
    assert not waiting.route("gone", "late") and not waiting.route("never", "x")
    assert len(waiting) == 0


async def test_a_lost_engine_answers_every_waiter_and_empties_the_registry() -> None:
    waiting: AwaitingAnswers[str] = AwaitingAnswers(lost)
    futures = {i: waiting.expect(i) for i in ("a", "b")}
    seen: list[str] = []
    waiting.add("c", seen.append)
    waiting.fail_all("the engine failed")
    assert {i: f.result() for i, f in futures.items()} == {
        "a": "lost a: the engine failed",
        "b": "lost b: the engine failed",
    }
    assert seen == ["lost c: the engine failed"] and len(waiting) == 0


async def test_answers_that_are_not_final_keep_the_waiter() -> None:
    waiting: AwaitingAnswers[str] = AwaitingAnswers(lost, final=lambda a: a.startswith("done"))
    seen: list[str] = []
    waiting.add("u", seen.append)
    assert waiting.route("u", "paused") and waiting.route("u", "loading") and "u" in waiting
    assert waiting.route("u", "done") and "u" not in waiting
    assert seen == ["paused", "loading", "done"]


async def test_then_sees_the_answer_before_the_caller_even_when_it_left() -> None:
    waiting: AwaitingAnswers[str] = AwaitingAnswers(lost)
    seen: list[str] = []
    future = waiting.expect("a", then=seen.append)
    future.cancel()  # the caller left
    waiting.route("a", "ok")
    assert seen == ["ok"]


async def test_an_id_waits_once() -> None:
    waiting: AwaitingAnswers[str] = AwaitingAnswers(lost)
    waiting.expect("a")
    with pytest.raises(AssertionError):
        waiting.expect("a")
