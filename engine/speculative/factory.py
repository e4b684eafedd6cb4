"""The engine's proposer, chosen by its configuration."""

from __future__ import annotations

from collections.abc import Callable

from engine.protocol.config import EngineConfig
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import Proposer
from engine.speculative.suffix import SuffixProposer


def make_proposer(
    config: EngineConfig, load_draft: Callable[[], Proposer] | None = None
) -> Proposer | None:
    """The proposer of `config.speculative_method`; None when speculation is off. `draft`
    needs the target loaded: `load_draft` builds it (engine/speculative/draft.py)."""
    match config.speculative_method:
        case "off":
            return None
        case "ngram":
            return NgramProposer(config.ngram_min, config.ngram_max)
        case "suffix":
            return SuffixProposer(config.ngram_min, config.ngram_max)
        case "draft":
            if load_draft is None:
                raise ValueError("speculative_method draft: needs the target model loaded")
            return load_draft()
        case other:
            raise ValueError(f"speculative_method: unknown method {other!r}")
