"""The suffix proposer against a plain brute-force reference (its own tokens and a store of
finished outputs, evicted oldest first), as a request grows, across finished rollouts and
adapters, and for the bounds of its store and the cost of a step."""

from __future__ import annotations

import random

import pytest

from engine.speculative.continuations import MAX_BRANCHES
from engine.speculative.suffix import DEFAULT_MIN_PROBABILITY, SuffixProposer
from tests.support.proposer_requests import CountingList, make_request


def counts_reference(sequences: list[list[int]], context: list[int]) -> dict[int, int]:
    """How often each token followed `context` in `sequences`, by scanning them."""
    counts: dict[int, int] = {}
    n = len(context)
    for seq in sequences:
        for start in range(len(seq) - n):
            if seq[start : start + n] == context:
                counts[seq[start + n]] = counts.get(seq[start + n], 0) + 1
    return counts


class StoreReference:
    """The store's rule, plainly: entries (adapter, prompt's last ngram_max tokens + output,
    at most `capacity` of them), the oldest dropped while the total is over capacity."""

    def __init__(self, ngram_max: int, capacity: int) -> None:
        self.ngram_max = ngram_max
        self.capacity = capacity
        self.entries: list[tuple[int, list[int]]] = []

    def add(self, adapter: int, prompt: list[int], output: list[int]) -> None:
        if not output or self.capacity == 0:
            return
        tail = prompt[max(0, len(prompt) - self.ngram_max) :]
        self.entries.append((adapter, (tail + output)[-self.capacity :]))
        while sum(len(tokens) for _, tokens in self.entries) > self.capacity:
            self.entries.pop(0)

    def sequences(self, adapter: int) -> list[list[int]]:
        return [tokens for key, tokens in self.entries if key == adapter]


def suffix_reference(
    own: list[int],
    stored: list[list[int]],
    lo: int,
    hi: int,
    limit: int,
    min_probability: float = DEFAULT_MIN_PROBABILITY,
) -> list[int]:
    """The rule, by brute force: each next token is the most frequent (then smallest)
    continuation of the longest context (own tokens + proposal so far, its last n tokens)
    seen in the request's own tokens or the stored outputs, while the running product of
    count / total stays at least `min_probability`."""
    context = list(own)
    proposal: list[int] = []
    probability = 1.0
    while len(proposal) < limit:
        counts: dict[int, int] = {}
        for n in range(min(hi, len(context)), lo - 1, -1):
            counts = counts_reference([own, *stored], context[len(context) - n :])
            if counts:
                break
        if not counts:
            break
        best = max(counts, key=lambda t: (counts[t], -t))
        probability *= counts[best] / sum(counts.values())
        if probability < min_probability:
            break
        proposal.append(best)
        context.append(best)
    return proposal


def random_tokens(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("seed", range(40))
def test_proposals_equal_the_brute_force_reference(seed):
    """Random finished requests (two adapters, a store small enough to evict), then random
    requests: the proposals are the reference's. The vocabulary is at most MAX_BRANCHES, so
    no context's branches overflow and the counts are exact."""
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, MAX_BRANCHES])
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 5)
    capacity = rng.choice([0, 10, 40, 1000])
    min_probability = rng.choice([0.0, 0.1, 0.5])
    proposer = SuffixProposer(lo, hi, store_tokens=capacity, min_probability=min_probability)
    reference = StoreReference(hi, capacity)
    for i in range(rng.randrange(0, 12)):
        prompt = random_tokens(rng, vocab, rng.randrange(0, 10))
        output = random_tokens(rng, vocab, rng.randrange(0, 25))
        adapter = rng.choice([0, 1])
        req = make_request(prompt + output, len(prompt), name=f"done{i}", adapter_key=adapter)
        proposer.finished(req)
        reference.add(adapter, prompt, output)
    for i in range(5):
        adapter = rng.choice([0, 1])
        req = make_request(
            random_tokens(rng, vocab, rng.randrange(0, 30)), name=f"new{i}", adapter_key=adapter
        )
        limit = rng.randint(1, 8)
        expected = suffix_reference(
            req.token_ids, reference.sequences(adapter), lo, hi, limit, min_probability
        )
        assert proposer.propose([req], [limit]) == [expected]


@pytest.mark.parametrize("seed", range(15))
def test_a_growing_request_proposes_what_a_fresh_proposer_would(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 4, MAX_BRANCHES])
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 4)
    stored = [random_tokens(rng, vocab, 20) for _ in range(3)]
    proposer = SuffixProposer(lo, hi, min_probability=0.0)
    for i, output in enumerate(stored):
        proposer.finished(make_request(output, 0, name=f"done{i}"))
    req = make_request(random_tokens(rng, vocab, rng.randrange(0, 10)), name="growing")
    for _ in range(25):
        limit = rng.randint(1, 6)
        fresh = SuffixProposer(lo, hi, min_probability=0.0)
        for i, output in enumerate(stored):
            fresh.finished(make_request(output, 0, name=f"done{i}"))
        got = proposer.propose([req], [limit])[0]
        assert got == fresh.propose([make_request(req.token_ids)], [limit])[0]
        assert got == suffix_reference(req.token_ids, stored, lo, hi, limit, 0.0)
        req.token_ids.extend(random_tokens(rng, vocab, rng.choice([1, 1, 3])))


def test_a_new_rollout_of_a_prompt_is_proposed_the_previous_rollouts_output():
    rng = random.Random(1)
    prompt = random_tokens(rng, 10_000, 30)
    output = random_tokens(rng, 10_000, 40)
    proposer = SuffixProposer(2, 4)
    proposer.finished(make_request(prompt + output, len(prompt), name="first"))
    rollout = make_request(prompt, name="second")
    # From the prompt's end, before the rollout has an output token of its own.
    assert proposer.propose([rollout], [4]) == [output[:4]]
    rollout.token_ids.extend(output[:10])
    assert proposer.propose([rollout], [6]) == [output[10:16]]


def test_the_most_frequent_continuation_is_proposed_first():
    proposer = SuffixProposer(2, 2)
    for i, output in enumerate([[1, 2, 7, 8], [1, 2, 5, 6], [1, 2, 7, 8]]):
        proposer.finished(make_request(output, 0, name=f"done{i}"))
    assert proposer.propose([make_request([9, 1, 2])], [3]) == [[7, 8]]


def test_an_uncertain_continuation_is_not_proposed():
    proposer = SuffixProposer(2, 2, min_probability=0.5)
    for i, output in enumerate([[1, 2, 3], [1, 2, 4], [1, 2, 5]]):
        proposer.finished(make_request(output, 0, name=f"done{i}"))
    assert proposer.propose([make_request([9, 1, 2])], [3]) == [[]]  # 1/3 < 0.5


def test_adapters_never_propose_each_others_outputs():
    rng = random.Random(2)
    prompt = random_tokens(rng, 10_000, 20)
    output = random_tokens(rng, 10_000, 20)
    proposer = SuffixProposer(2, 4)
    proposer.finished(make_request(prompt + output, len(prompt), name="a", adapter_key=1))
    assert proposer.propose([make_request(prompt, name="b", adapter_key=2)], [4]) == [[]]
    assert proposer.propose([make_request(prompt, name="base", adapter_key=0)], [4]) == [[]]
    assert proposer.propose([make_request(prompt, name="c", adapter_key=1)], [4]) == [output[:4]]


@pytest.mark.parametrize("capacity", [1, 7, 50, 300])
def test_the_store_holds_at_most_its_capacity_evicting_the_oldest(capacity):
    rng = random.Random(capacity)
    hi = 3
    proposer = SuffixProposer(1, hi, store_tokens=capacity)
    reference = StoreReference(hi, capacity)
    for i in range(60):
        prompt = random_tokens(rng, 50, rng.randrange(0, 8))
        output = random_tokens(rng, 50, rng.randrange(0, 40))
        adapter = rng.choice([0, 1, 2])
        proposer.finished(
            make_request(prompt + output, len(prompt), name=str(i), adapter_key=adapter)
        )
        reference.add(adapter, prompt, output)
        store = proposer.store
        assert sum(len(tokens) for _, tokens in store.entries) == store.num_tokens <= capacity
        assert list(store.entries) == reference.entries
        # A table holds at most one context per n per stored token of its adapter.
        for key, table in store.tables.items():
            assert len(table) <= hi * sum(len(s) for s in reference.sequences(key))


def test_evicting_every_output_empties_the_tables_even_when_branches_overflowed():
    """A context followed by more distinct tokens than it tracks undercounts them; removing
    what was added still leaves nothing behind."""
    proposer = SuffixProposer(1, 2, store_tokens=100)
    rng = random.Random(3)
    for i in range(10):
        output = [7, 7] + [t for k in range(20) for t in (7, rng.randrange(1000))]
        proposer.finished(make_request(output, 0, name=str(i)))
        counts = proposer.store.tables[0].get((7,))
        assert counts is not None and len(counts) <= MAX_BRANCHES
    # An output as long as the store evicts every other one; its adapter's table is apart.
    proposer.finished(make_request(list(range(2000, 2100)), 0, name="last", adapter_key=9))
    assert [key for key, _ in proposer.store.entries] == [9]
    assert set(proposer.store.tables) == {9}  # adapter 0's table emptied, then dropped


def test_finished_frees_the_requests_own_table_and_stores_only_outputs():
    proposer = SuffixProposer(2, 3)
    a = make_request([1, 2, 3, 1, 2], 5, name="a")
    proposer.propose([a], [2])
    assert a.key in proposer.own
    proposer.finished(a)  # no output: nothing stored
    assert proposer.own == {} and proposer.store.num_tokens == 0
    b = make_request([1, 2, 3, 4, 5, 6], 4, name="b")
    proposer.finished(b)
    assert [tokens for _, tokens in proposer.store.entries] == [[2, 3, 4, 5, 6]]


def test_a_weight_update_keeps_the_store():
    proposer = SuffixProposer(2, 2)
    proposer.finished(make_request([1, 2, 3, 4], 0, name="done"))
    req = make_request([9, 1, 2])
    before = proposer.propose([req], [2])
    proposer.weights_updated()
    assert proposer.propose([req], [2]) == before == [[3, 4]]


def test_the_store_alone_proposes_while_the_requests_own_table_catches_up():
    rng = random.Random(5)
    prompt = random_tokens(rng, 10_000, 30)
    output = random_tokens(rng, 10_000, 10)
    proposer = SuffixProposer(2, 3, index_budget=8)
    proposer.finished(make_request(prompt + output, len(prompt), name="first"))
    # The new request repeats its own prompt's start at its end: only its own table knows.
    req = make_request(prompt + prompt[:5], name="second")
    first = proposer.propose([req], [4])[0]
    assert first == []  # its own table covers 8 of 35 tokens; the store has no match
    for _ in range(4):  # 34 more positions, 8 a call
        proposer.propose([req], [4])
    assert proposer.propose([req], [4]) == [prompt[5:9]]
    rollout = make_request(prompt, name="third")  # the store proposes at once
    assert proposer.propose([rollout], [4]) == [output[:4]]


def test_a_step_reads_only_the_new_tokens_however_long_the_prompt():
    """Counted in token reads, not timed: a 100,000-token prompt is read once,
    `index_budget` tokens a step; a step then reads its new token's window and the context,
    whatever the prompt's length."""
    lo, hi, limit, budget = 2, 4, 5, 4096
    rng = random.Random(0)
    proposer = SuffixProposer(lo, hi, index_budget=budget)
    for i in range(20):
        proposer.finished(make_request(random_tokens(rng, 50, 200), 0, name=f"done{i}"))
    prompt = CountingList(rng.randrange(50) for _ in range(100_000))
    req = make_request([])
    req.token_ids = prompt
    catching_up = []
    for _ in range(-(-(len(prompt) - 1) // budget)):  # once, in budget-sized parts
        before = prompt.reads
        proposer.propose([req], [limit])
        catching_up.append(prompt.reads - before)
    assert proposer.own[req.key].length == len(prompt)
    assert max(catching_up) <= (hi + 1) * budget + hi
    per_step = []
    for _ in range(50):
        prompt.append(rng.randrange(50))
        before = prompt.reads
        proposer.propose([req], [limit])
        per_step.append(prompt.reads - before)
    assert max(per_step) <= 2 * (hi + 1)  # the new token's window, then the context
    assert len(proposer.own[req.key].counts) <= (hi - lo + 1) * len(prompt)


@pytest.mark.parametrize("seed", range(10))
def test_counts_never_exceed_the_occurrences_of_the_outputs_present(seed):
    """With more distinct continuations than a context tracks, adding and evicting outputs
    keeps every count positive and at most what a scan of the stored outputs finds."""
    rng = random.Random(seed)
    proposer = SuffixProposer(1, 2, store_tokens=120)
    for i in range(30):
        proposer.finished(
            make_request(random_tokens(rng, 30, rng.randrange(1, 40)), 0, name=str(i))
        )
        present = [tokens for _, tokens in proposer.store.entries]
        for table in proposer.store.tables.values():
            for context in table.table:
                counts = table.get(context)
                assert counts is not None
                occurrences = counts_reference(present, list(context))
                assert all(0 < count <= occurrences[t] for t, count in counts.items())


@pytest.mark.parametrize("seed", range(10))
def test_evicting_leaves_the_tables_of_the_outputs_present(seed):
    """Removal is the exact inverse of adding (no context overflows its branches here): after
    any evictions, each adapter's table reads as one built from its outputs still stored."""
    rng = random.Random(seed)
    proposer = SuffixProposer(1, 3, store_tokens=rng.choice([15, 60]))
    for i in range(25):
        output = random_tokens(rng, rng.choice([2, MAX_BRANCHES]), rng.randrange(1, 20))
        adapter = rng.choice([0, 1])
        proposer.finished(make_request(output, 0, name=str(i), adapter_key=adapter))
        for adapter, table in proposer.store.tables.items():
            fresh = SuffixProposer(1, 3, store_tokens=10_000)
            for key, tokens in proposer.store.entries:
                if key == adapter:
                    fresh.store.add(key, [], tokens)
            rebuilt = fresh.store.tables[adapter]
            assert set(table.table) == set(rebuilt.table)
            assert all(table.get(c) == rebuilt.get(c) for c in table.table)
            for context in table.table:
                sequences = proposer.store.entries
                present = [tokens for key, tokens in sequences if key == adapter]
                assert table.get(context) == counts_reference(present, list(context))
