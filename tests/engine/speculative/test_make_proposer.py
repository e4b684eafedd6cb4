"""make_proposer: the configured method's proposer, with the configured match lengths."""

from __future__ import annotations

from typing import Any

import pytest

from engine.protocol.config import EngineConfig
from engine.speculative.factory import make_proposer
from engine.speculative.ngram import NgramProposer
from engine.speculative.suffix import SuffixProposer


def config(**speculative: Any) -> EngineConfig:
    return EngineConfig(model="unused", device="cpu", **speculative)


def test_off_makes_no_proposer():
    assert make_proposer(config()) is None


@pytest.mark.parametrize(("method", "kind"), [("ngram", NgramProposer), ("suffix", SuffixProposer)])
def test_each_host_method_makes_its_proposer_with_the_configured_lengths(method, kind):
    proposer = make_proposer(config(speculative_method=method, ngram_min=3, ngram_max=5))
    assert isinstance(proposer, kind)
    assert proposer.method == method
    assert (proposer.ngram_min, proposer.ngram_max) == (3, 5)


def test_draft_is_built_by_the_loader_the_engine_passes():
    cfg = config(speculative_method="draft", speculative_draft_model="/nowhere")
    built = NgramProposer(2, 4)  # any Proposer: the loader's result is the proposer
    assert make_proposer(cfg, lambda: built) is built
    with pytest.raises(ValueError, match="speculative_method draft"):
        make_proposer(cfg)
