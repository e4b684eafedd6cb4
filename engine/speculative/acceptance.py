"""Acceptance: how far a request's proposals tend to be right, and so how many to verify.

Verifying a proposal costs a row of the forward pass whether it is kept or not, so a request
speculates only as far as its proposals are likely right. Each verification judges the kept
proposals and the first rejected one (those after it were never judged); their counts decay by
DECAY per verification, so the estimate follows the text: a request that starts copying its
prompt speculates again. From the estimated chance `a` that a proposal is kept, the request
verifies k proposals where the k-th is kept with chance a**k >= MIN_CHANCE (none known yet:
all it may). When that leaves none, the request backs off: it skips 1, 2, 4 ... 2**MAX_SHIFT
steps, then verifies one proposal (a probe) into the same estimate; a probe that brings the
estimate back ends the backing off, one that does not doubles the next wait.
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
    probing: bool = False  # its next verification is a probe of one proposal

    def length(self, most: int, step: int) -> int:
        """How many proposals to verify at `step` (at most `most`); 0 while it backs off."""
        if step < self.until:
            return 0
        if self.probing:
            return 1
        k = self._worth(most)
        if k == 0:
            self.until = step + 1 + (1 << min(self.backoffs, MAX_SHIFT))
            self.backoffs += 1
            self.probing = True
        return k

    def record(self, kept: int, proposed: int) -> None:
        """A verification kept `kept` of `proposed` proposals."""
        self.kept = DECAY * self.kept + kept
        self.judged = DECAY * self.judged + kept + (kept < proposed)
        self.probing = False
        if self._worth(1):
            self.backoffs = 0

    def _worth(self, most: int) -> int:
        """The proposals worth verifying by the estimate (at most `most`)."""
        if self.kept == self.judged:  # nothing judged yet, or every proposal kept
            return most
        chance = self.kept / self.judged
        if chance <= MIN_CHANCE:
            return 0
        return min(most, int(math.log(MIN_CHANCE) / math.log(chance)))
