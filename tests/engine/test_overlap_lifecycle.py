"""The overlapped loop between steps: cancels, deadlines and weight updates that arrive while a
step is in flight end as in the plain loop; the host really runs ahead of the device; a device
failure surfaces; tensor parallelism turns overlap off."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.core.step_loop import overlap_enabled
from engine.protocol.messages import InflightPolicy, RequestOutput, UpdateWeights
from tests.support.overlap_runs import (
    Request,
    Seen,
    assert_all_pages_returned,
    assert_block_table_matches,
    both,
    make_engine,
    run,
    when,
)
from tests.support.tiny_models import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True)
PROMPTS = [[0, 17, 42, 99, 123, 7, 88, 5], [0, 9, 8, 7, 6, 5, 4, 3, 2, 1, 200], [0, 55, 66]]


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


def three(params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]


Seens = dict[tuple[str, int], Seen]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_cancel_mid_flight_ends_with_the_tokens_the_client_saw(
    tiny_llama: Path, params: SamplingParams
) -> None:
    hook = when("r1", 4, lambda engine: engine.abort(["r1"]))
    plain, overlapped, engine = both(tiny_llama, three(params), hook)
    assert overlapped == plain
    assert plain[("r1", 0)].finish_reason is FinishReason.CANCELLED
    assert plain[("r1", 0)].completion_tokens == 4
    assert_all_pages_returned(engine)


def test_one_sample_of_n_cancelled_mid_flight_ends_as_in_the_plain_loop(tiny_llama: Path) -> None:
    hook = when("r0", 3, lambda engine: engine.abort(["r0"], index=1))
    reqs = [Request("r0", PROMPTS[0], SEEDED, n=3), *three(SEEDED)[1:]]
    plain, overlapped, engine = both(tiny_llama, reqs, hook)
    assert overlapped == plain
    assert plain[("r0", 1)].finish_reason is FinishReason.CANCELLED
    assert_all_pages_returned(engine)


def test_a_deadline_passing_mid_flight_ends_as_in_the_plain_loop(tiny_llama: Path) -> None:
    def expire(engine: LLMEngine) -> None:
        engine.requests["r2"][0].deadline = 0.0  # passed: the next step's boundary ends it

    plain, overlapped, engine = both(tiny_llama, three(GREEDY), when("r2", 3, expire))
    assert overlapped == plain
    assert plain[("r2", 0)].finish_reason is FinishReason.DEADLINE_EXCEEDED
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("policy", list(InflightPolicy), ids=lambda p: p.name)
def test_a_weight_update_mid_flight_lands_where_the_plain_loop_lands_it(
    tiny_llama: Path, checkpoint_b: Path, policy: InflightPolicy
) -> None:
    def update(engine: LLMEngine) -> None:
        engine.start_weight_update(UpdateWeights("u", 0, policy, checkpoint_dir=str(checkpoint_b)))
        engine.add_request("late", PROMPTS[0], GREEDY)

    # max_num_seqs=2: r2 waits in the queue while the update arrives.
    plain, overlapped, engine = both(
        tiny_llama, three(GREEDY), when("r0", 5, update), max_num_seqs=2
    )
    assert overlapped == plain
    assert {v for s in plain.values() for v in s.versions} == {0, 1}
    assert [e.phase for e in engine.updater.events][-1].name == "APPLIED"
    assert_all_pages_returned(engine)


def test_live_weights_mid_flight_equal_the_plain_loop(tiny_llama: Path) -> None:
    def scale(engine: LLMEngine) -> None:
        with engine.live_weights(policy_version=3) as params:
            params["lm_head.weight"].mul_(1.5)

    plain, overlapped, _ = both(tiny_llama, three(SEEDED), when("r1", 4, scale))
    assert overlapped == plain
    assert 3 in plain[("r1", 0)].versions


def test_step_returns_while_the_device_thread_still_runs_the_forward(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, True)
    release = threading.Event()
    forward = engine.runner.model.forward

    def held_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        assert release.wait(timeout=30), "the test never released the forward"
        return forward(*args, **kwargs)

    engine.runner.model.forward = held_forward  # type: ignore[method-assign]
    engine.add_request("r", PROMPTS[0], GREEDY)
    assert engine.step() == []  # launched, not waited for: the forward is still held
    assert engine.has_work() and engine.overlap is not None and engine.overlap.busy
    release.set()
    outputs: list[RequestOutput] = []
    while engine.has_work():
        outputs += engine.step()
    assert sum(len(o.new_token_ids) for o in outputs) == GREEDY.max_tokens


def test_a_failure_on_the_device_thread_surfaces_from_step(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, True)

    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("device fault")

    engine.runner.model.forward = broken  # type: ignore[method-assign]
    engine.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="device fault"):
        for _ in range(3):
            engine.step()


def test_tensor_parallelism_turns_overlap_off() -> None:
    assert overlap_enabled(EngineConfig(overlap_steps=True))
    assert not overlap_enabled(EngineConfig(overlap_steps=True, tensor_parallel_size=2))
    assert not overlap_enabled(EngineConfig())


def test_an_update_behind_a_step_that_preempted_lands_one_step_later(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    msg = UpdateWeights("u", 0, InflightPolicy.RECOMPUTE, checkpoint_dir=str(checkpoint_b))

    def update(engine: LLMEngine) -> None:
        if engine.overlap is not None:  # as if its schedule had preempted: it cannot be undone
            assert engine.overlap.inflight is not None
            engine.overlap.inflight.preempted = True
        engine.start_weight_update(msg)

    plain = run(make_engine(tiny_llama, False), three(GREEDY), when("r0", 6, update))
    engine = make_engine(tiny_llama, True)
    overlapped = run(engine, three(GREEDY), when("r0", 5, update))
    assert overlapped == plain
    assert plain[("r0", 0)].versions == [0] * 6 + [1] * 8
    assert_all_pages_returned(engine)


def test_a_request_admitted_by_the_undone_step_runs_on_the_new_weights(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    msg = UpdateWeights("u", 0, InflightPolicy.DRAIN, checkpoint_dir=str(checkpoint_b))
    add_mid = when("r0", 3, lambda engine: engine.add_request("mid", PROMPTS[1], GREEDY))
    undone: list[bool] = []

    def start(engine: LLMEngine) -> None:
        assert engine.overlap is not None and engine.overlap.inflight is not None
        mid = engine.requests["mid"][0]
        assert mid.pages  # admitted by the step in flight
        engine.start_weight_update(msg)  # undoes it: mid goes back to the queue
        assert not mid.pages and mid.slot is None and mid in engine.scheduler.waiting
        assert_block_table_matches(engine)  # the rows and slots it took are back
        undone.append(True)

    drain = when("r0", 4, start)

    def hooks(engine: LLMEngine, out: RequestOutput, seen: Seens) -> None:
        add_mid(engine, out, seen)
        drain(engine, out, seen)

    engine = make_engine(tiny_llama, True)
    seen = run(engine, three(GREEDY)[:1], hooks)  # the step in flight at the update admitted mid
    fresh = run(make_engine(checkpoint_b, False), [Request("mid", PROMPTS[1], GREEDY)])
    assert seen[("mid", 0)].token_ids == fresh[("mid", 0)].token_ids
    assert set(seen[("mid", 0)].versions) == {1} and set(seen[("r0", 0)].versions) == {0}
    assert engine.stats().prefix_cache_queries == len(PROMPTS[0]) + len(PROMPTS[1])  # once each
    assert undone == [True]
    assert_all_pages_returned(engine)
