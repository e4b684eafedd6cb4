"""PromptScores: a request's prompt logprobs, collected chunk by chunk as its prompt is computed.

The token at prompt position p is scored by the logits of position p - 1, so scoring positions
[start, prompt_len) puts the hidden states of positions [start - 1, prompt_len - 1) through the
LM head. A step that computes prompt positions [computed, computed + n) of a request scores
the positions of `span(computed, n)`; the model runner computes them (engine/execution/
prompt_scoring.py) and `record` stores them by position, so a chunk computed twice (after a
preemption, or a rewound overlapped step) simply writes the same positions again.

Until every position is scored, the request may reuse cached prefix pages only below position
start - 1 (`cache_limit`): a cached prefix must not hide a position to score.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol.messages import PromptLogprobs


@dataclass(frozen=True)
class ScoreSpan:
    """Prompt positions [first, first + count) that one step scores for one request; their
    rows in the step's packed tokens start at `row`."""

    first: int
    count: int
    row: int


class PromptScores:
    def __init__(
        self, start: int, prompt_len: int, num_top: int, routed_experts: bool = False
    ) -> None:
        self.start = start
        self.prompt_len = prompt_len
        self.num_top = num_top  # top logprobs per position (0: none)
        self.logprobs: list[float | None] = [None] * (prompt_len - start)
        self.top: list[tuple[list[int], list[float]] | None] = [None] * len(self.logprobs)
        self.missing = len(self.logprobs)
        # Each scored position's routed experts, when asked (recorded by `record_routing`)
        self.routed: list[list[int]] | None = None
        if routed_experts:
            self.routed = [[] for _ in self.logprobs]

    @property
    def complete(self) -> bool:
        return self.missing == 0

    @property
    def cache_limit(self) -> int:
        """Tokens of the prompt the prefix cache may supply: the first scored position's
        logits come from position start - 1, which must be computed."""
        return self.start - 1

    def span(self, computed: int, num_tokens: int, row: int) -> ScoreSpan | None:
        """The positions scored by a step computing positions [computed, computed +
        num_tokens), whose first token is packed row `row`; None if it scores none."""
        first = max(computed + 1, self.start)
        end = min(computed + num_tokens + 1, self.prompt_len)
        if first >= end:
            return None
        return ScoreSpan(first, end - first, row + first - 1 - computed)

    def record(self, first: int, rows: list[list[float]]) -> None:
        """Store the scores of positions first, first + 1, ...: each row is [logprob, k top
        ids, k top logprobs] (k >= num_top; the first num_top are kept)."""
        k, n = self.num_top, (len(rows[0]) - 1) // 2 if rows else 0
        for i, row in enumerate(rows, first - self.start):
            if self.logprobs[i] is None:
                self.missing -= 1
            self.logprobs[i] = row[0]
            if k:
                self.top[i] = ([int(t) for t in row[1 : 1 + k]], row[1 + n : 1 + n + k])

    def record_routing(self, first: int, rows: list[list[int]]) -> None:
        """Store the routed experts of the rows scoring positions first, first + 1, ...
        (each [MoE layer, k] flattened), when asked for."""
        if self.routed is not None:
            self.routed[first - self.start : first - self.start + len(rows)] = rows

    def result(self) -> PromptLogprobs:
        assert self.complete, "prompt logprobs reported before every position was scored"
        logprobs = [lp for lp in self.logprobs if lp is not None]
        top = [t for t in self.top if t is not None] if self.num_top else None
        return PromptLogprobs(self.start, logprobs, top, self.routed)
