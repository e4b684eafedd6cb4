"""RequestGrammar: one constrained sequence's matcher: the tokens it accepted, its next mask.

Every sample of a request (n > 1) has its own. Its state follows the tokens appended to the
request (engine/core/postprocess.py accepts each), so preemption and recomputation leave it as is.
Used from one thread at a time: the host between steps, the step's mask fill while it runs.
"""

from __future__ import annotations

from typing import Any

import torch


class RequestGrammar:
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (its mask
        allowed nothing: the text cannot continue)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The text is complete and ended (EOS accepted, or nothing more is possible)."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w is
        token 32w + i)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
