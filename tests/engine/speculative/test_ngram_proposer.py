"""The ngram proposer (prompt lookup) against a plain brute-force reference, against vLLM's own
documented cases, incrementally as a request grows, and for the cost of a step."""

from __future__ import annotations

import random

import pytest

from engine.speculative.ngram import NgramProposer
from tests.support.proposer_requests import CountingList, make_request


def lookup_reference(tokens: list[int], ngram_min: int, ngram_max: int, limit: int) -> list[int]:
    """The rule, by brute force: the longest n whose last-n-token suffix occurs earlier
    (starting before the suffix does); the tokens after its earliest such occurrence."""
    end = len(tokens)
    for n in range(ngram_max, ngram_min - 1, -1):
        if n > end:
            continue
        suffix = tokens[end - n :]
        for start in range(end - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + limit]
    return []


def propose_once(tokens: list[int], ngram_min: int, ngram_max: int, limit: int) -> list[int]:
    return NgramProposer(ngram_min, ngram_max).propose([make_request(tokens)], [limit])[0]


# vLLM's tests/v1/spec_decode/test_ngram.py: (tokens, min, max, k, its expected draft).
VLLM_CASES = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # "return on the first match"
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram wins, not [5, 1]
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),  # the first
    ([], 2, 2, 2, []),
    ([1, 2, 3, 1, 2], 2, 2, 2, [3, 1]),
]


@pytest.mark.parametrize(("tokens", "lo", "hi", "limit", "expected"), VLLM_CASES)
def test_proposals_equal_vllms_documented_ones(tokens, lo, hi, limit, expected):
    assert propose_once(tokens, lo, hi, limit) == expected
    assert lookup_reference(tokens, lo, hi, limit) == expected  # the reference agrees too


@pytest.mark.parametrize("seed", range(40))
def test_proposals_equal_the_brute_force_reference_on_random_tokens(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
    lo = rng.randint(1, 4)
    hi = rng.randint(lo, 6)
    limit = rng.randint(1, 8)
    assert propose_once(tokens, lo, hi, limit) == lookup_reference(tokens, lo, hi, limit)


@pytest.mark.parametrize("seed", range(20))
def test_a_growing_request_proposes_what_a_fresh_proposer_would(seed):
    """The incremental index, extended by one or several tokens a step, equals an index
    built from scratch at every length."""
    rng = random.Random(seed)
    vocab = rng.choice([2, 4, 8])
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 5)
    proposer = NgramProposer(lo, hi)
    req = make_request([rng.randrange(vocab) for _ in range(rng.randrange(0, 20))])
    for _ in range(30):
        limit = rng.randint(1, 6)
        got = proposer.propose([req], [limit])[0]
        assert got == propose_once(req.token_ids, lo, hi, limit)
        assert got == lookup_reference(req.token_ids, lo, hi, limit)
        req.token_ids.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5])))


def test_no_match_proposes_nothing():
    assert propose_once([1, 2, 3, 4, 5, 6], 1, 3, 4) == []


def test_a_match_at_the_very_end_proposes_up_to_the_end_only():
    # The suffix [7, 8] occurred just before it: its continuation is the suffix itself.
    assert propose_once([1, 7, 8, 7, 8], 2, 2, 5) == [7, 8]
    # A run of one token: the earliest occurrence of [5, 5] is followed by the rest.
    assert propose_once([5, 5, 5, 5], 2, 2, 8) == [5, 5]


def test_limit_one_proposes_one_token():
    assert propose_once([1, 2, 3, 1, 2], 2, 2, 1) == [3]


def test_ngram_min_longer_than_the_tokens_proposes_nothing():
    assert propose_once([4, 4, 4], 4, 6, 3) == []
    assert propose_once([4], 1, 1, 3) == []


def test_each_request_of_a_batch_gets_its_own_proposal():
    proposer = NgramProposer(2, 2)
    a = make_request([1, 2, 3, 1, 2], name="a")
    b = make_request([7, 8, 9, 7, 8], name="b")
    c = make_request([4, 5, 6], name="c")
    assert proposer.propose([a, b, c], [2, 2, 2]) == [[3, 1], [9, 7], []]


def test_finished_frees_the_requests_index():
    proposer = NgramProposer(2, 3)
    a, b = make_request([1, 2, 1, 2], name="a"), make_request([3, 4, 3, 4], name="b")
    proposer.propose([a, b], [2, 2])
    proposer.finished(a)
    assert set(proposer.indexes) == {b.key}
    proposer.finished(b)
    proposer.finished(b)  # twice is harmless
    assert proposer.indexes == {}


def test_a_request_whose_tokens_shrank_is_reindexed():
    proposer = NgramProposer(2, 2)
    req = make_request([1, 2, 3, 1, 2])
    assert proposer.propose([req], [2]) == [[3, 1]]
    req.token_ids[:] = [9, 8, 9]
    assert proposer.propose([req], [2]) == [[]]
    req.token_ids.append(8)
    assert proposer.propose([req], [2]) == [[9, 8]]


def test_a_prompt_longer_than_the_index_budget_proposes_once_indexed():
    """A call indexes at most `index_budget` tokens of a request; it proposes nothing until
    its index has caught up, then what the reference proposes."""
    rng = random.Random(4)
    tokens = [rng.randrange(6) for _ in range(35)]
    proposer = NgramProposer(2, 3, index_budget=10)
    req = make_request(tokens)
    # Positions 1.. are indexed 10 a call: 1-10, 11-20, 21-30, 31-34.
    assert [proposer.propose([req], [3])[0] for _ in range(3)] == [[], [], []]
    assert proposer.propose([req], [3]) == [lookup_reference(tokens, 2, 3, 3)] != [[]]


@pytest.mark.parametrize("seed", range(10))
def test_a_growing_request_under_a_small_budget_proposes_the_reference_once_caught_up(seed):
    rng = random.Random(seed)
    proposer = NgramProposer(1, 3, index_budget=rng.randint(1, 4))
    req = make_request([rng.randrange(3) for _ in range(rng.randrange(0, 20))])
    for _ in range(30):
        got = proposer.propose([req], [4])[0]
        caught_up = proposer.indexes[req.key].length == len(req.token_ids)
        assert got == (lookup_reference(req.token_ids, 1, 3, 4) if caught_up else [])
        req.token_ids.extend(rng.randrange(3) for _ in range(rng.choice([1, 1, 2, 5])))


def test_a_step_reads_only_the_new_tokens_however_long_the_prompt():
    """The cost of a step, counted in token reads, does not grow with the context: a
    100,000-token prompt is read once, `index_budget` tokens a step, then each step reads
    its new token and a few more."""
    hi, limit, budget = 4, 5, 4096
    rng = random.Random(0)
    prompt = CountingList(rng.randrange(50) for _ in range(100_000))
    proposer = NgramProposer(2, hi, index_budget=budget)
    req = make_request([])
    req.token_ids = prompt
    catching_up = []
    for _ in range(-(-(len(prompt) - 1) // budget)):  # once, in budget-sized parts
        before = prompt.reads
        proposer.propose([req], [limit])
        catching_up.append(prompt.reads - before)
    assert proposer.indexes[req.key].length == len(prompt)
    assert max(catching_up) <= hi * budget + hi * (hi - 1) + limit
    per_step = []
    for _ in range(50):
        prompt.append(rng.randrange(50))
        before = prompt.reads
        proposer.propose([req], [limit])
        per_step.append(prompt.reads - before)
    # The new token's window, the suffix looked up per n, the proposal.
    assert max(per_step) <= hi + hi * (hi - 1) + limit
    # Memory: at most one entry per n per token.
    assert len(proposer.indexes[req.key]) <= (hi - 2 + 1) * len(prompt)
