"""The compile queue's fairness: callers served in turn, one running compile per caller, and a
job whose caller left dropped before it runs."""

from __future__ import annotations

from engine.protocol.messages import Constraint
from engine.structured.compile_queue import CompileJob, CompileQueue


def job(caller: str, regex: str) -> CompileJob:
    return CompileJob(Constraint("regex", regex), caller)


def queue_of(*jobs: CompileJob) -> CompileQueue:
    queue = CompileQueue()
    for j in jobs:
        queue.put(j)
    return queue


def test_a_caller_with_a_compile_running_waits_while_another_callers_job_is_taken() -> None:
    a1, a2, b1 = job("a", "a1"), job("a", "a2"), job("b", "b1")
    queue = queue_of(a1, a2, b1)
    assert queue.take(0) is a1
    assert queue.take(1) is b1  # a2 arrived first, but `a` already compiles
    queue.finish(a1)
    assert queue.take(0) is a2


def test_callers_are_served_in_turn_not_in_order_of_arrival() -> None:
    jobs = [job("a", f"a{i}") for i in range(3)] + [job("b", "b0"), job("c", "c0")]
    queue = queue_of(*jobs)
    taken = []
    for _ in jobs:
        taken.append(queue.take(0))
        queue.finish(taken[-1])
    assert [j.constraint.text for j in taken] == ["a0", "b0", "c0", "a1", "a2"]


def test_a_job_removed_before_it_is_taken_is_never_taken() -> None:
    a1, b1 = job("a", "a1"), job("b", "b1")
    queue = queue_of(a1, b1)
    with queue.lock:
        assert queue.remove(a1)
    assert queue.take(0) is b1
    assert len(queue) == 0
    with queue.lock:
        assert not queue.remove(b1)  # taken: the pool kills its worker instead


def test_take_returns_none_once_the_queue_is_closed() -> None:
    queue = queue_of(job("a", "a1"))
    assert queue.take(0) is not None
    queue.close()
    assert queue.take(1) is None
