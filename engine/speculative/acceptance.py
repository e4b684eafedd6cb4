"""Acceptance: how far a request's proposals tend to be right, and so how many to verify.

Verifying a proposal costs a token of the forward pass whether it is kept or not, so a request
speculates only as far as its proposals are likely right. Each verification judges the kept
proposals and the first rejected one (those after it were never judged); their counts decay by
DECAY per verification, so the estimate follows the text: a request that starts copying its
prompt speculates again. From the estimated chance `a` that a proposal is kept, the request
verifies k proposals where the k-th is kept with chance a**k >= MIN_CHANCE (none known yet:
all it may). When that leaves none, the request backs off: it skips 1, 2, 4 ... 2**MAX_SHIFT
steps, forgets its estimate, and tries again with every proposal it may have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.8
MIN_CHANCE = 0.3
MAX_SHIFT = 6


@dataclass
class Acceptance:
    kept: float = 0.0  # proposals kept, decayed
    judged: float = 0.0  # proposals judged (kept, and the first rejected one), decayed
    backoffs: int = 0  # times in a row it backed off
    until: int = 0  # the first step it may speculate again

    def length(self, most: int, step: int) -> int:
        """How many proposals to verify at `step` (at most `most`); 0 to back off."""
        if step < self.until:
            return 0
        if not self.judged or self.kept == self.judged:
            return most
        chance = self.kept / self.judged
        k = 0 if chance <= 0.0 else int(math.log(MIN_CHANCE) / math.log(chance))
        if k >= 1:
            return min(k, most)
        self.until = step + 1 + (1 << min(self.backoffs, MAX_SHIFT))
        self.backoffs += 1
        self.kept = self.judged = 0.0  # the next try starts afresh
        return 0

    def record(self, kept: int, proposed: int) -> None:
        """A verification kept `kept` of `proposed` proposals."""
        self.kept = DECAY * self.kept + kept
        self.judged = DECAY * self.judged + kept + (kept < proposed)
        if kept:
            self.backoffs = 0
