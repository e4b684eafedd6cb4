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
        self._words = (compiled.tokenizer_info.vocab_size + 31) // 32
        # Speculative decoding: the masks after each prefix of the draft check_draft kept
        # (engine/execution/draft_rows.py), for the step that verifies it
        self.draft_masks: list[torch.Tensor] = []

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

    def check_draft(self, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` the grammar allows from its state, short of a token
        that would end the text; keeps the mask before each of its tokens and after the last
        in `draft_masks`. The matcher's state is left as it was."""
        masks: list[torch.Tensor] = []
        kept = 0
        for token in draft:
            masks.append(self._next_mask())
            word, bit = divmod(token, 32)
            if word >= self._words or not (int(masks[-1][word]) >> bit) & 1:
                break
            if not self._matcher.accept_token(token):
                break
            kept += 1
            if self._matcher.is_terminated():  # its request stops at this token: no more
                self._matcher.rollback(1)
                kept -= 1
                break
        if kept == len(masks):
            masks.append(self._next_mask())
        if kept:
            self._matcher.rollback(kept)
        self.draft_masks = masks[: kept + 1]
        return draft[:kept]

    def _next_mask(self) -> torch.Tensor:
        """[words] int32: the tokens allowed next from the matcher's state."""
        mask = torch.full((1, self._words), -1, dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]
