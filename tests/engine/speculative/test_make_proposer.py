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


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"speculative_method": "eagle"}, "speculative_method: expected one of"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens: must be at least 1"),
        ({"num_speculative_tokens": 10**6}, "num_speculative_tokens: at most 64"),
        ({"speculative_max_batch": 0}, "speculative_max_batch: must be at least 1"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_max: must be at least ngram_min"),
        ({"speculative_method": "draft"}, "speculative_draft_model: required"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(settings: dict[str, Any], says: str):
    with pytest.raises(ValueError, match=says):
        config(**settings)


def test_the_step_buffers_hold_the_rows_of_every_request_that_may_propose():
    from engine.execution.model_shard import draft_rows

    assert draft_rows(config()) == 0
    assert draft_rows(config(speculative_method="ngram")) == 8 * 4
    cfg = config(speculative_method="ngram", speculative_max_batch=500, max_num_seqs=16)
    assert draft_rows(cfg) == 16 * 4  # no more propose than run at once
