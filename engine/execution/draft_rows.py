"""A step whose requests verify speculative drafts, as one decode row per fed token.

A request verifying a draft feeds its last token and the draft's k tokens. Each of those
k + 1 tokens becomes a row of its own: a shallow copy of the request (a view) whose
`token_ids` end with the draft's first j tokens and whose computed tokens are j more. To the
runner the row is a decode of one token at position `num_computed_tokens + j`, reading the
request's pages (its slot) up to itself: its K and V are written with every other row's before
any row attends, so token j sees the draft before it. The step is then a plain decode step
(fill_decode, the decode attention kernels, CUDA graphs, row i sampling token i) of more rows,
or a mixed step with prefill chunks.

Everything the sampler derives from a request follows the view too: the noise counter (its
output index), the penalties' history, min_tokens, bad words that end the output, and, for a
constrained request, the grammar's mask after the draft's first j tokens (computed when the
draft was checked: engine/structured/request_grammar.py). Views live for one step; the step
loop maps their samples back to the request (engine/speculative/verify.py).
"""

from __future__ import annotations

import copy

import torch

from engine.scheduling.request import Request
from engine.scheduling.scheduler import ScheduledBatch


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
        view.num_computed_tokens = req.num_computed_tokens + j
        view.draft = []
        if masks is not None:
            view.grammar = DraftMask(masks[j])  # type: ignore[assignment]
        views.append(view)
    return views


def as_decode_rows(batch: ScheduledBatch) -> tuple[ScheduledBatch, dict[Request, Request]]:
    """`batch` with each request that verifies a draft replaced by its views, one token each;
    and the views' requests (view -> request). A batch with no draft comes back as it is."""
    if not batch.drafts:
        return batch, {}
    rows = ScheduledBatch(block_table=batch.block_table)
    verifying: dict[Request, Request] = {}
    for req, num_tokens in zip(batch.requests, batch.query_lens, strict=True):
        if not req.draft:
            rows.add(req, num_tokens)
            continue
        for view in draft_rows(req):
            rows.add(view, 1)
            verifying[view] = req
    return rows, verifying
