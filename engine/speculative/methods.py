"""The proposer a configuration names (--speculative-method)."""

from __future__ import annotations

from engine.protocol.config import EngineConfig
from engine.speculative.proposer import Proposer


def make_proposer(config: EngineConfig) -> Proposer | None:
    """The configured proposer; None when speculation is off."""
    if config.speculative_method == "off":
        return None
    raise NotImplementedError(f"speculative_method {config.speculative_method!r}")
