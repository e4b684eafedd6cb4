"""The Proposer interface: what a speculative method implements.

Each step, before scheduling, the engine asks its proposer for tokens to follow each eligible
decoding request's `token_ids` (every token of which is known on the host: prompt and output).
The step then feeds the request's last token and its proposals through the target model in one
pass and keeps the longest prefix of proposals the target's own sampling reproduces, plus the
target's next token (engine/speculative/verify.py). A proposal therefore never changes which
tokens a request gets, only how many arrive per step.

A proposer is deterministic given what it has seen: its proposals are a function of the
request's tokens (and, for `suffix`, of the outputs it was shown finished). The engine calls it
from one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.scheduling.request import Request


class Proposer(Protocol):
    method: str  # "ngram", "suffix", "draft": the label of its metrics

    def propose(self, reqs: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """For each request, at most `limits[i]` (>= 1) tokens to follow its `token_ids`, most
        likely first; [] where it has nothing to propose. Called once per step with every
        request that may speculate this step."""
        ...

    def finished(self, req: Request) -> None:
        """`req` ended (any reason): forget what is kept for it (a store of finished outputs
        may keep its tokens)."""
        ...

    def weights_updated(self) -> None:
        """The target's weights changed: drop whatever was derived from the old ones."""
        ...
