"""Speculative decoding between steps and across the engine's features: cancels and deadlines
end a request with a prefix of its tokens; a weight update (every inflight policy) drops the
drafts in flight and every token carries the version that sampled it; LoRA requests verify on
their adapter; two tensor-parallel ranks verify what one does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine import FinishReason, LLMEngine, SamplingParams
from engine.protocol.messages import InflightPolicy, UpdateWeights
from tests.support.lora_adapters import make_adapter
from tests.support.overlap_runs import (
    Request,
    Seen,
    assert_all_pages_returned,
    make_engine,
    run,
    when,
)
from tests.support.spec_runs import ReplayProposer, assert_same, spec_engine
from tests.support.tiny_models import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=True)
SEEDED = replace(GREEDY, temperature=0.9, top_p=0.9, seed=11)
PROMPTS = [[0, 17, 42, 99, 123, 7, 88, 5], [0, 9, 8, 7, 6, 5, 4, 3, 2, 1, 200], [0, 55, 66]]
Seens = dict[tuple[str, int], Seen]


def three(params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("end", ["cancel", "deadline"])
def test_a_request_ended_mid_flight_keeps_a_prefix_of_its_tokens(
    tiny_llama: Path, overlap: bool, end: str
) -> None:
    def stop(engine: LLMEngine) -> None:
        if end == "cancel":
            engine.abort(["r1"])
        else:
            engine.requests["r1"][0].deadline = 0.0  # the next step's boundary ends it

    plain = run(make_engine(tiny_llama, False), three(SEEDED))
    engine = spec_engine(tiny_llama, ReplayProposer(plain, 0.0), overlap=overlap)
    spec = run(engine, three(SEEDED), when("r1", 3, stop))
    got, want = spec[("r1", 0)], plain[("r1", 0)]
    reason = FinishReason.CANCELLED if end == "cancel" else FinishReason.DEADLINE_EXCEEDED
    assert got.finish_reason is reason
    assert 3 <= len(got.token_ids) < len(want.token_ids)
    assert got.token_ids == want.token_ids[: len(got.token_ids)]
    assert got.completion_tokens == len(got.token_ids)
    assert_same(
        {k: v for k, v in spec.items() if k[0] != "r1"},
        {k: v for k, v in plain.items() if k[0] != "r1"},
    )
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("policy", list(InflightPolicy), ids=lambda p: p.name)
def test_a_weight_update_mid_flight_keeps_every_token_with_its_version(
    tiny_llama: Path, checkpoint_b: Path, policy: InflightPolicy, overlap: bool
) -> None:
    def update(engine: LLMEngine) -> None:
        engine.start_weight_update(UpdateWeights("u", 0, policy, checkpoint_dir=str(checkpoint_b)))
        engine.add_request("late", PROMPTS[0], GREEDY)

    # max_num_seqs=2: r2 waits in the queue while the update arrives; it and "late" run on
    # the new weights only, in both engines.
    plain = run(
        make_engine(tiny_llama, False, max_num_seqs=2), three(GREEDY), when("r0", 5, update)
    )
    replay = ReplayProposer(plain, 0.2)
    engine = spec_engine(tiny_llama, replay, overlap=overlap, max_num_seqs=2)
    spec = run(engine, three(GREEDY), when("r0", 5, update))
    assert [e.phase for e in engine.updater.events][-1].name == "APPLIED"
    assert_same(
        {k: spec[k] for k in [("r2", 0), ("late", 0)]},
        {k: plain[k] for k in [("r2", 0), ("late", 0)]},
    )
    assert set(spec[("late", 0)].versions) == {1}
    for key in [("r0", 0), ("r1", 0)]:
        got, want = spec[key], plain[key]
        assert got.versions == sorted(got.versions) and got.versions.count(0) >= 5
        # Sampled before the swap in both engines: the old weights' tokens, the same ones.
        old = min(got.versions.count(0), want.versions.count(0))
        assert got.token_ids[:old] == want.token_ids[:old]
    assert_all_pages_returned(engine)


def test_lora_requests_verify_on_their_adapter(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    adapter = make_adapter(tiny_llama, tmp_path_factory.mktemp("adapter") / "a", r=8)
    reqs = [
        replace(r, params=replace(r.params, adapter="a" if i % 2 else ""))
        for i, r in enumerate(three(SEEDED))
    ]
    plain_engine = make_engine(tiny_llama, False, max_loras=1, max_lora_rank=8)
    plain_engine.load_adapter("a", adapter)
    plain = run(plain_engine, reqs)
    engine = spec_engine(tiny_llama, ReplayProposer(plain, 0.3), max_loras=1, max_lora_rank=8)
    engine.load_adapter("a", adapter)
    spec = run(engine, reqs)
    assert_same(spec, plain)
    assert engine.stats().spec_accepted_tokens > 0
    base = run(make_engine(tiny_llama, False), [three(SEEDED)[1]])
    assert base[("r1", 0)].token_ids != plain[("r1", 0)].token_ids  # the adapter matters


def test_two_tensor_parallel_ranks_verify_what_one_does(tiny_llama: Path) -> None:
    reqs = three(GREEDY) + [Request("s", PROMPTS[1], SEEDED)]
    one = run(make_engine(tiny_llama, False), reqs)
    engine = spec_engine(tiny_llama, ReplayProposer(one, 0.3), tensor_parallel_size=2)
    try:
        spec = run(engine, reqs)
        assert engine.stats().spec_accepted_tokens > 0
    finally:
        engine.close()
    assert_same(spec, one)
