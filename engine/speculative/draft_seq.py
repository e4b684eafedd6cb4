"""DraftSeq: what the draft model keeps of one request: its tokens as the draft last saw them
(the request's, then the draft's own proposals), how many of them have KV in the draft's pool,
and the pages and block-table slot that KV is in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class DraftSeq:
    """`token_ids[:known]` are the request's tokens at the last sync, the rest the draft's
    proposals; the KV of `token_ids[:num_computed_tokens]` is in `pages`. A step feeds
    `token_ids[num_computed_tokens:]` (engine/execution/step_inputs.py's StepRow)."""

    key: tuple[str, int]  # the request's
    token_ids: list[int] = field(default_factory=list)
    known: int = 0
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    slot: int | None = None  # its row in the draft's BlockTable while it holds pages
    group_pages: list[list[int]] = field(default_factory=list)  # KV groups 1..: as `pages`

    def sync(self, request_tokens: list[int]) -> None:
        """Take the request's tokens, which extend those of the last sync (a request's tokens
        only grow). The KV of the proposals the request's new tokens repeat (the accepted
        ones) stays; from the first that differs on it is recomputed, over the same pages."""
        start = self.known
        if len(request_tokens) < start:  # not an extension: start over
            start = self.num_computed_tokens = 0
        new = request_tokens[start:]
        held = self.token_ids[start : self.num_computed_tokens]  # proposals with KV
        match = 0
        for mine, theirs in zip(held, new, strict=False):
            if mine != theirs:
                break
            match += 1
        self.num_computed_tokens = min(self.num_computed_tokens, start + match)
        del self.token_ids[start:]
        self.token_ids.extend(new)
        self.known = len(self.token_ids)
        # The next token's logits come from the last token's row: feed it again if its KV is
        # all there is (same token, same position: the same KV rewritten).
        self.num_computed_tokens = min(self.num_computed_tokens, self.known - 1)

    def input_id(self, position: int) -> int:
        return self.token_ids[position]

    def input_ids(self, start: int, count: int) -> list[int]:
        return self.token_ids[start : start + count]
