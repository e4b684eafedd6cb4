"""The overlapped loop gives every client exactly what the plain loop gives: tokens, logprobs,
finish reasons and counts, through finishes, stop tokens, preemption, chunked prefill, n > 1,
penalties and the prefix cache."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine import FinishReason, SamplingParams
from engine.execution.cuda_graph import GraphOutput
from tests.support.overlap_runs import Request, assert_all_pages_returned, both, make_engine, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=16, ignore_eos=True
)


def some_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 300) for _ in range(length + 3 * i)] for i in range(count)]


def requests_of(prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Request]:
    """Staggered lengths, so requests end at different steps while others run on."""
    return [
        Request(f"r{i}", p, replace(params, max_tokens=5 + 3 * i), n) for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_equal_the_plain_loop_token_for_token(
    tiny_llama: Path, params: SamplingParams
) -> None:
    plain, overlapped, engine = both(tiny_llama, requests_of(some_prompts(6, 7), params))
    assert overlapped == plain
    assert {s.finish_reason for s in plain.values()} == {FinishReason.LENGTH}
    assert [s.completion_tokens for s in plain.values()] == [5, 8, 11, 14, 17, 20]
    assert_all_pages_returned(engine)


def test_logprobs_and_top_logprobs_equal_the_plain_loop(tiny_llama: Path) -> None:
    params = replace(SEEDED, logprobs=True, top_logprobs=3)
    plain, overlapped, _ = both(tiny_llama, requests_of(some_prompts(4, 9), params))
    assert overlapped == plain
    assert all(len(s.logprobs) == len(s.token_ids) == len(s.top) for s in plain.values())


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_stop_tokens_end_each_request_at_the_same_token(
    tiny_llama: Path, params: SamplingParams
) -> None:
    prompts = some_prompts(5, 6, seed=3)
    free, _, _ = both(tiny_llama, requests_of(prompts, params))
    # Each request stops on the token it would sample at its (i + 1)-th step.
    stopping = []
    for i, (r, s) in enumerate(zip(requests_of(prompts, params), free.values(), strict=True)):
        stop = s.token_ids[min(i + 1, len(s.token_ids) - 1)]
        stopping.append(Request(r.request_id, r.prompt, replace(r.params, stop_token_ids=[stop])))
    plain, overlapped, engine = both(tiny_llama, stopping)
    assert overlapped == plain
    assert FinishReason.STOP in {s.finish_reason for s in plain.values()}
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_in_a_tiny_pool_gives_the_same_outputs(
    tiny_llama: Path, params: SamplingParams
) -> None:
    tight = {"num_kv_pages": 14, "page_size": 4, "enable_prefix_cache": False}
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(some_prompts(8, 8))]
    plain, overlapped, engine = both(tiny_llama, reqs, **tight)
    assert engine.stats().preemptions > 0
    assert overlapped == plain
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("penalty", [1.0, 1.1], ids=["overlapped", "collected-first"])
def test_a_request_that_fills_the_whole_pool_ends_as_in_the_plain_loop(
    tiny_llama: Path, penalty: float
) -> None:
    # 6 pages of 4 tokens: a 7-token prompt plus 17 tokens fill them all; one more is an ERROR.
    # With a penalty each step is collected before the next is scheduled: the ERROR that
    # schedule makes still comes after the collected step's token.
    params = replace(GREEDY, max_tokens=40, repetition_penalty=penalty)
    reqs = [Request("r", some_prompts(1, 6)[0], params)]
    plain, overlapped, engine = both(tiny_llama, reqs, num_kv_pages=6, page_size=4)
    assert overlapped == plain
    assert plain[("r", 0)].finish_reason is FinishReason.ERROR
    assert_all_pages_returned(engine)


def test_chunked_prefill_gives_the_same_outputs(tiny_llama: Path) -> None:
    reqs = requests_of(some_prompts(4, 40), SEEDED)
    plain, overlapped, engine = both(tiny_llama, reqs, max_num_batched_tokens=16)
    assert overlapped == plain
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_n_above_one_gives_the_same_samples(tiny_llama: Path, params: SamplingParams) -> None:
    reqs = requests_of(some_prompts(3, 9), params, n=3)
    plain, overlapped, engine = both(tiny_llama, reqs, page_size=4)
    assert overlapped == plain and len(plain) == 9
    assert_all_pages_returned(engine)


def test_penalties_give_the_same_outputs(tiny_llama: Path) -> None:
    params = replace(SEEDED, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    plain, overlapped, _ = both(tiny_llama, requests_of(some_prompts(4, 5), params))
    assert overlapped == plain


def test_a_penalised_request_beside_rows_decoding_on_pending_tokens(tiny_llama: Path) -> None:
    # The penalised request joins while the greedy ones decode on tokens still in flight: the
    # sampler reads token histories then, and only the penalised row's may be read.
    penalised = replace(SEEDED, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=6)

    def join(engine, out, seen) -> None:  # type: ignore[no-untyped-def]
        if out.request_id == "r0" and len(seen[("r0", 0)].token_ids) == 3:
            engine.add_request("late", some_prompts(1, 6, seed=5)[0], penalised)

    plain, overlapped, engine = both(tiny_llama, requests_of(some_prompts(3, 7), GREEDY), join)
    assert overlapped == plain and len(plain[("late", 0)].token_ids) == 6
    assert_all_pages_returned(engine)


def test_a_second_request_hits_the_pages_the_first_published(tiny_llama: Path) -> None:
    prompt = some_prompts(1, 40)[0]

    def then_again(engine, out, seen) -> None:  # type: ignore[no-untyped-def]
        if out.request_id == "first" and out.finished:
            engine.add_request("second", prompt + seen[("first", 0)].token_ids[:5], GREEDY)

    reqs = [Request("first", prompt, GREEDY)]
    plain, overlapped, engine = both(tiny_llama, reqs, then_again, page_size=4)
    assert overlapped == plain
    assert plain[("second", 0)].cached_tokens >= 40  # the prompt and some generated tokens
    assert_all_pages_returned(engine)


def test_graphed_decode_steps_read_pending_tokens_into_the_static_inputs(tiny_llama: Path) -> None:
    reqs = requests_of(some_prompts(5, 7), SEEDED)
    results, patched = [], []
    for overlap in (False, True):
        engine = make_engine(tiny_llama, overlap)
        engine.runner.attach_graphs(capture=False)  # the padded graph step, run eagerly
        graphs = engine.runner.graphs
        assert graphs is not None

        def counted(*args: Any, run_graph: Any = graphs.run) -> GraphOutput:
            patched.append(len(args) == 5 and args[4] is not None)
            return run_graph(*args)

        graphs.run = counted  # type: ignore[method-assign]
        results.append(run(engine, reqs))
    assert results[1] == results[0]
    assert any(patched), "no graphed step read a pending token"
