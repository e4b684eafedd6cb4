"""Builders for the speculative decoding tests: proposers whose proposals the tests control,
and an engine that verifies them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine import LLMEngine
from engine.scheduling.request import Request
from engine.speculative.verify import SpecDecoder
from tests.support import overlap_runs
from tests.support.overlap_runs import Seen, make_engine


class ReplayProposer:
    """Proposes what a run without speculation produced next (`outputs`, by request key),
    each token replaced by a wrong one with probability `wrong`, and sometimes nothing:
    the verification sees long accepted runs, early rejections and empty drafts."""

    method = "replay"

    def __init__(self, outputs: dict[tuple[str, int], Seen], wrong: float, seed: int = 0) -> None:
        self.outputs = outputs
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.calls: list[int] = []  # requests proposed for, per call
        self.ended: list[tuple[str, int]] = []

    def propose(self, reqs: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        self.calls.append(len(reqs))
        drafts = []
        for req, limit in zip(reqs, limits, strict=True):
            seen = self.outputs[req.key].token_ids
            done = req.num_output_tokens
            draft = list(seen[done : done + self.rng.randint(0, limit)])
            for i in range(len(draft)):
                if self.rng.random() < self.wrong:
                    draft[i] = (draft[i] + self.rng.randrange(1, 50)) % 300
            drafts.append(draft)
        return drafts

    def finished(self, req: Request) -> None:
        self.ended.append(req.key)

    def weights_updated(self) -> None:
        pass


def spec_engine(
    checkpoint: Path,
    proposer: object,
    num_tokens: int = 4,
    max_batch: int = 8,
    overlap: bool = False,
    decoder: type[SpecDecoder] = SpecDecoder,
    **overrides: object,
) -> LLMEngine:
    """An engine that verifies `proposer`'s drafts (a Proposer): built speculating (its step
    buffers hold the drafts' rows), then given `proposer` in place of its own."""
    spec = {"num_speculative_tokens": num_tokens, "speculative_max_batch": max_batch}
    engine = make_engine(checkpoint, overlap, speculative_method="ngram", **spec, **overrides)
    engine.loop.speculate(decoder(proposer, num_tokens, max_batch))  # type: ignore[arg-type]
    return engine


def assert_same(spec: dict[tuple[str, int], Seen], plain: dict[tuple[str, int], Seen]) -> None:
    """Each client saw the same tokens, versions, ends and counts; logprobs within 1e-5 (the
    verification's wider forward sums in another order)."""
    assert spec.keys() == plain.keys()
    for key, want in plain.items():
        got = spec[key]
        assert got.token_ids == want.token_ids, key
        assert got.finish_reason == want.finish_reason, key
        assert got.completion_tokens == want.completion_tokens, key
        assert got.cached_tokens == want.cached_tokens, key
        assert got.versions == want.versions, key
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5), key
        assert [t[0] for t in got.top] == [t[0] for t in want.top], key


def compare(
    checkpoint: Path,
    requests: Sequence[overlap_runs.Request],
    on_output: overlap_runs.OnOutput | None = None,
    wrong: float = 0.3,
    overlap: bool = False,
    **overrides: object,
) -> tuple[dict[tuple[str, int], Seen], dict[tuple[str, int], Seen], LLMEngine]:
    """(results without speculation, results verifying ReplayProposer's drafts of them, the
    speculating engine), each engine built with `overrides`."""
    plain = overlap_runs.run(make_engine(checkpoint, False, **overrides), requests, on_output)
    engine = spec_engine(checkpoint, ReplayProposer(plain, wrong), overlap=overlap, **overrides)
    spec = overlap_runs.run(engine, requests, on_output)
    assert engine.stats().spec_accepted_tokens > 0, "nothing was verified"
    return plain, spec, engine
