"""Lossless in distribution: over many seeds, the tokens emitted at verified positions are
distributed as decoding without speculation distributes them (a chi-square test between two
independent sets of seeds); an acceptance rule that keeps every proposal fails the same test."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from scipy.stats import chi2_contingency

from engine import SamplingParams
from engine.scheduling.request import Request as EngineRequest
from engine.speculative.verify import SpecDecoder
from tests.support.overlap_runs import Request, make_engine, run
from tests.support.spec_runs import spec_engine

PROMPT = [0, 17, 42, 99, 123, 7]
SEEDS = 500
PARAMS = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)


class FixedProposer:
    """Proposes the same two tokens after every output: deterministic, often wrong."""

    method = "fixed"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, reqs: Sequence[EngineRequest], limits: Sequence[int]) -> list[list[int]]:
        return [self.tokens[:limit] for limit in limits]

    def finished(self, req: EngineRequest) -> None:
        pass

    def weights_updated(self) -> None:
        pass


class KeepsEverything(SpecDecoder):
    """A broken acceptance rule: every proposal kept, whatever was sampled."""

    def _verify(self, req: EngineRequest, tokens: list[int]) -> int:
        req.draft = list(tokens[: len(req.draft)])  # "equal": each compares to itself
        return super()._verify(req, tokens)


def tokens_at(seen: dict, position: int) -> Counter[int]:  # type: ignore[type-arg]
    return Counter(s.token_ids[position] for s in seen.values())


def requests(first_seed: int) -> list[Request]:
    return [
        Request(f"s{seed}", PROMPT, SamplingParams(**{**PARAMS.__dict__, "seed": seed}))
        for seed in range(first_seed, first_seed + SEEDS)
    ]


def p_value(a: Counter[int], b: Counter[int]) -> float:
    """Two-sample chi-square over the tokens either side drew (rare ones pooled)."""
    common = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
    rows = [[a[t] for t in common], [b[t] for t in common]]
    rows[0].append(sum(a.values()) - sum(rows[0]))
    rows[1].append(sum(b.values()) - sum(rows[1]))
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return float(chi2_contingency(rows).pvalue)


@pytest.mark.parametrize("decoder", [SpecDecoder, KeepsEverything], ids=["exact", "broken"])
def test_verified_positions_are_distributed_as_without_speculation(
    tiny_llama: Path, decoder: type[SpecDecoder]
) -> None:
    plain = run(make_engine(tiny_llama, False), requests(first_seed=10_000))
    guess = [tokens_at(plain, 1).most_common(1)[0][0], tokens_at(plain, 2).most_common(1)[0][0]]
    engine = spec_engine(tiny_llama, FixedProposer(guess), 2, max_batch=128, decoder=decoder)
    spec = run(engine, requests(first_seed=0))  # other seeds: independent samples
    assert engine.stats().spec_accepted_tokens > 0
    p = min(p_value(tokens_at(spec, i), tokens_at(plain, i)) for i in (1, 2))
    if decoder is SpecDecoder:
        assert p > 1e-3, p
    else:
        assert p < 1e-6, p
