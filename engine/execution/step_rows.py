"""Which rows of a step go through the LM head: PreparedStep.

After the step's tokens are packed, each request whose tokens reach their end samples from
its last row (its n > 1 siblings too, from the same row), and each request scoring its prompt
(engine/scheduling/prompt_scores.py) adds the rows of the positions it scores this step. The
row indices go into the host buffer `sample_rows`, sampled rows first, unless row i samples
token i (the steady decode step: no gather before the LM head).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.execution.step_inputs import StepArrays
from engine.scheduling.prompt_scores import ScoreSpan
from engine.scheduling.request import Request
from engine.scheduling.scheduler import ScheduledBatch


@dataclass
class PreparedStep:
    """A step's shape, once its inputs are in the host buffers."""

    num_tokens: int
    num_seqs: int
    width: int  # block-table width
    sampling: list[Request]  # one per sampled row (siblings share their leader's row)
    rows_are_tokens: bool  # row i samples token i: no gather before the LM head
    num_rows: int  # sampled rows (a worker rank knows only their number)
    scoring: list[tuple[Request, ScoreSpan]]  # prompt positions scored, after the sampled rows
    num_scored: int  # their rows

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, sequences, block-table width): what forward_inputs reads the host buffers
        by (a worker rank has only those, not the requests)."""
        return self.num_tokens, self.num_seqs, self.width


def lm_head_rows(batch: ScheduledBatch, arrays: StepArrays, width: int) -> PreparedStep:
    """Which requests sample, from which token row, then which rows score prompt positions
    (all written to `sample_rows` unless row i samples token i, the steady decode case).
    A request scoring its prompt only (max_tokens 0) never samples."""
    reqs, lens = batch.requests, batch.query_lens
    num_seqs, num_tokens = len(reqs), batch.num_tokens
    ends = [
        r.num_computed_tokens + n == len(r.token_ids) + r.num_pending and r.max_tokens > 0
        for r, n in zip(reqs, lens, strict=True)
    ]
    forks = any([r.pending_forks for r in reqs])
    if num_tokens == num_seqs and all(ends) and not forks:  # steady decode: row i, token i
        # (no prompt position to score: a request's last prompt token scores none)
        return PreparedStep(num_tokens, num_seqs, width, list(reqs), True, num_seqs, [], 0)
    rows: list[int] = []
    sampling: list[Request] = []
    starts = arrays.query_start_loc[: num_seqs + 1].tolist()
    for r, end, row in zip(reqs, ends, starts[1:], strict=True):
        if end:
            # Siblings (n > 1) sample their first tokens from the leader's last prompt row.
            for seq in [r, *r.pending_forks] if r.pending_forks else [r]:
                rows.append(row - 1)
                sampling.append(seq)
    scoring = _scored_spans(batch, starts)
    num_sampled = len(sampling)
    for _, span in scoring:
        rows += range(span.row, span.row + span.count)
    rows_are_tokens = len(rows) == num_tokens and rows == list(range(num_tokens))
    if not rows_are_tokens:
        arrays.sample_rows[: len(rows)] = rows
    num_scored = len(rows) - num_sampled
    return PreparedStep(
        num_tokens, num_seqs, width, sampling, rows_are_tokens, num_sampled, scoring, num_scored
    )


def _scored_spans(batch: ScheduledBatch, starts: list[int]) -> list[tuple[Request, ScoreSpan]]:
    """The prompt positions this step scores, per request that asked for prompt logprobs."""
    spans = []
    for r, n, row in zip(batch.requests, batch.query_lens, starts, strict=False):
        if r.prompt_scores is not None:
            span = r.prompt_scores.span(r.num_computed_tokens, n, row)
            if span is not None:
                spans.append((r, span))
    return spans
