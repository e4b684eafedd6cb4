"""Each speculative method, wired into the engine by its flag, gives exactly the tokens of
decoding without speculation; and each one's proposals are verified and kept where right."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.speculative.draft import DraftProposer
from tests.support.overlap_runs import Request, assert_all_pages_returned, make_engine, run
from tests.support.spec_runs import assert_same

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
SEEDED = replace(GREEDY, temperature=0.8, top_k=20, seed=3)


def copy_heavy(params: SamplingParams, count: int = 4) -> list[Request]:
    """Prompts that repeat a span, so prompt lookup finds matches."""
    rng = random.Random(1)
    reqs = []
    for i in range(count):
        span = [rng.randrange(2, 300) for _ in range(6 + i)]
        reqs.append(Request(f"r{i}", [0, *span, *span, *span[:3]], params))
    return reqs


def compare(checkpoint: Path, reqs: list[Request], **spec: object):  # type: ignore[no-untyped-def]
    plain = run(make_engine(checkpoint, False, page_size=4), reqs)
    engine = make_engine(checkpoint, False, page_size=4, **spec)
    got = run(engine, reqs)
    assert_same(got, plain)
    assert_all_pages_returned(engine)
    return engine


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_host_methods_give_the_tokens_of_decoding_without_them(
    tiny_llama: Path, method: str, params: SamplingParams
) -> None:
    engine = compare(tiny_llama, copy_heavy(params), speculative_method=method, ngram_min=1)
    assert engine.stats().spec_proposed_tokens > 0


def test_suffix_proposes_a_finished_output_to_its_repeat(tiny_llama: Path) -> None:
    reqs = copy_heavy(GREEDY, count=2)
    engine = make_engine(tiny_llama, False, speculative_method="suffix")
    first = run(engine, reqs)
    before = engine.stats().spec_accepted_tokens
    again = run(engine, [replace(r, request_id=r.request_id + "-again") for r in reqs])
    for r in reqs:
        assert again[(r.request_id + "-again", 0)].token_ids == first[(r.request_id, 0)].token_ids
    # The repeats' outputs are the finished ones: nearly every proposal is kept.
    accepted = engine.stats().spec_accepted_tokens - before
    assert accepted >= 0.8 * sum(len(s.token_ids) - 1 for s in again.values()) - 2 * len(reqs)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_draft_model_gives_the_tokens_of_decoding_without_it(
    tiny_llama: Path, params: SamplingParams
) -> None:
    # The target as its own draft: greedy proposals are the target's own greedy tokens.
    spec = {"speculative_method": "draft", "speculative_draft_model": str(tiny_llama)}
    engine = compare(tiny_llama, copy_heavy(params), **spec)
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 0
    if params is GREEDY:
        assert stats.spec_accepted_tokens == stats.spec_proposed_tokens


def scenario(params: SamplingParams) -> list[Request]:
    """n > 1, two prompts sharing a prefix (prefix-cache hits), a stop id, staggered lengths."""
    reqs = copy_heavy(params, count=3)
    reqs[0] = replace(reqs[0], n=2)
    shared = reqs[1].prompt
    reqs.append(Request("shared", shared[:-2] + [5, 6], replace(params, max_tokens=30)))
    reqs[2] = replace(reqs[2], params=replace(params, stop_token_ids=(reqs[2].prompt[3],)))
    return reqs


SPEC = {
    "ngram": {"speculative_method": "ngram", "ngram_min": 1},
    "suffix": {"speculative_method": "suffix", "ngram_min": 1},
    "draft": {"speculative_method": "draft"},
}
# A small pool (preemption), a small step budget (chunked prefill), pages of 4 tokens.
TIGHT = {"num_kv_pages": 40, "max_num_batched_tokens": 12, "page_size": 4}
EVERY_STEP = {"speculative_max_batch": 16}  # the scenario runs 10 sequences


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("method", sorted(SPEC))
def test_every_method_through_preemption_chunks_prefix_hits_forks_and_stops(
    tiny_llama: Path, method: str, overlap: bool
) -> None:
    spec = dict(SPEC[method])
    if method == "draft":
        spec["speculative_draft_model"] = str(tiny_llama)
    reqs = scenario(SEEDED) + [replace(r, request_id=r.request_id + "g") for r in scenario(GREEDY)]
    plain = run(make_engine(tiny_llama, overlap, **TIGHT), reqs)
    engine = make_engine(tiny_llama, overlap, **TIGHT, **EVERY_STEP, **spec)
    got = run(engine, reqs)
    assert_same(got, plain)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 0
    assert any(s.cached_tokens for s in plain.values())
    assert_all_pages_returned(engine)


def test_a_draft_model_under_two_tensor_parallel_ranks(tiny_llama: Path) -> None:
    reqs = copy_heavy(GREEDY) + [replace(copy_heavy(SEEDED)[0], request_id="s")]
    plain = run(make_engine(tiny_llama, False), reqs)
    spec = {"speculative_method": "draft", "speculative_draft_model": str(tiny_llama)}
    whole = make_engine(tiny_llama, False, **spec)
    assert_same(run(whole, reqs), plain)
    engine = make_engine(tiny_llama, False, tensor_parallel_size=2, **spec)
    try:
        assert isinstance(proposer := engine.loop.spec.proposer, DraftProposer)
        assert proposer.draft.model.tp.size == 2  # rank 0 holds half the draft; rank 1 the rest
        assert_same(run(engine, reqs), plain)
        # The split draft proposes what the whole one does: as many proposals, as many kept.
        counts = (engine.stats().spec_proposed_tokens, engine.stats().spec_accepted_tokens)
        assert counts == (whole.stats().spec_proposed_tokens, whole.stats().spec_accepted_tokens)
        assert counts[1] > 0
    finally:
        engine.close()
