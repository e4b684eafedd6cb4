"""The engine's proposer, chosen by its configuration."""

from __future__ import annotations

from engine.protocol.config import EngineConfig
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import Proposer
from engine.speculative.suffix import SuffixProposer


def make_proposer(config: EngineConfig) -> Proposer | None:
    """The proposer of `config.speculative_method`; None when speculation is off."""
    match config.speculative_method:
        case "off":
            return None
        case "ngram":
            return NgramProposer(config.ngram_min, config.ngram_max)
        case "suffix":
            return SuffixProposer(config.ngram_min, config.ngram_max)
        case "draft":
            raise NotImplementedError("speculative_method draft: not wired yet")
        case other:
            raise ValueError(f"speculative_method: unknown method {other!r}")
