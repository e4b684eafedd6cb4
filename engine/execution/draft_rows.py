"""The sampling rows of a request whose draft a step verifies: one view per fed position.

Row j samples the token after `token_ids + draft[:j]`: a shallow copy of the request whose
`token_ids` are those, so everything the sampler derives from a request follows: the noise
counter (its output index), the penalties' history, min_tokens, bad words that end the output,
and, for a constrained request, the grammar's mask after the draft's first j tokens (computed
when the draft was checked: engine/structured/request_grammar.py). The sampling slot is the
request's own (the same parameters). Views live for one step; only the sampler reads them.
"""

from __future__ import annotations

import copy

import torch

from engine.scheduling.request import Request


class DraftMask:
    """A view's grammar: the mask the request's grammar computed for that position."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask  # [words] int32

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row, : self.mask.shape[0]].copy_(self.mask)  # as the matcher fills it


def draft_rows(req: Request) -> list[Request]:
    """The views of `req` for its last fed token and each proposal after it (len(draft) + 1)."""
    draft = req.draft
    masks = req.grammar.draft_masks if req.grammar is not None else None
    views = []
    for j in range(len(draft) + 1):
        view = copy.copy(req)
        view.token_ids = req.token_ids + draft[:j] if j else req.token_ids
        view.draft = []
        if masks is not None:
            view.grammar = DraftMask(masks[j])  # type: ignore[assignment]
        views.append(view)
    return views
