"""SpecDecoder: proposals before a step, acceptance after it.

Before a step is scheduled, each eligible decoding request gets up to K proposed tokens in
`Request.draft` (engine/speculative/proposer.py). The scheduler feeds such a request its last
token and its proposals in one pass (engine/scheduling/scheduler.py), and the step samples one
row per fed position (engine/execution/draft_rows.py): row j with the request's own sampling,
as if its tokens were `token_ids + draft[:j]` (its history, its noise counter, its grammar's
state). Row j's token is therefore exactly the token the engine without speculation samples at
that position once the j proposals before it are the sequence's tokens.

Acceptance keeps proposals while each equals the token sampled before it, and then the first
sampled token that differs (or, every proposal kept, the token after the last): a + 1 tokens
for a accepted proposals, each the one decoding without speculation produces, greedy or
sampled. For sampled requests this is rejection sampling (Leviathan et al.) with a point-mass
proposal, coupled by the counter-based noise: a proposal d is kept with probability p(d), and a
rejected one's replacement is drawn from p with d excluded, renormalised, as the rule asks; the
coupling makes it token-exact under a seed, not only equal in distribution.

The KV of rejected proposals is past the request's computed tokens: the next step writes over
it (the pages taken for it stay the request's, for its next tokens), and the prefix cache
never publishes a page that holds it (pages are published up to the computed tokens only).

Speculation costs a wider forward where proposals are rejected, so it is off for a step with
more than `max_batch` decoding requests, and each request verifies only as many proposals as
its recent acceptance makes worthwhile, backing off when that is none
(engine/speculative/acceptance.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from engine.execution.launched_step import Sampled
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import ScheduledBatch
from engine.speculative.acceptance import Acceptance
from engine.speculative.proposer import Proposer


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_tokens: int, max_batch: int) -> None:
        self.proposer = proposer
        self.method = proposer.method
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.proposed_tokens = 0  # cumulative, for the engine's stats
        self.accepted_tokens = 0
        self._step = 0
        self._acceptance: dict[Request, Acceptance] = {}
        self._drafted: list[Request] = []  # requests given a draft by the last propose
        self._policy_version: int | None = None

    def wants_host(self, num_running: int) -> bool:
        """The next step may speculate: its requests' tokens must be on the host."""
        return num_running <= self.max_batch

    def propose(
        self, running: Sequence[Request], hold: Collection[Request], policy_version: int
    ) -> None:
        """Give each eligible decoding request its draft for the next step."""
        self._step += 1
        if policy_version != self._policy_version:
            if self._policy_version is not None:
                self.proposer.weights_updated()
            self._policy_version = policy_version
        if len(running) > self.max_batch:
            return
        reqs, limits = [], []
        for req in running:
            limit = self._limit(req, hold)
            if limit > 0:
                reqs.append(req)
                limits.append(limit)
        if not reqs:
            return
        for req, draft in zip(reqs, self.proposer.propose(reqs, limits), strict=True):
            draft = draft[: self.num_tokens]
            if draft and req.grammar is not None:
                draft = req.grammar.check_draft(draft)
            if draft:
                req.draft = draft
                self._drafted.append(req)

    def _limit(self, req: Request, hold: Collection[Request]) -> int:
        """How many tokens `req` may have proposed this step (0: none)."""
        if (
            req.status is not RequestStatus.RUNNING
            or req.num_pending
            or len(req.token_ids) - req.num_computed_tokens != 1  # not decoding
            or not req.params.speculative
            or req.pending_forks
            or req.prompt_scores is not None
            or req in hold
        ):
            return 0
        acceptance = self._acceptance.get(req)
        most = self.num_tokens
        if acceptance is not None:
            most = acceptance.length(most, self._step)
        # Never past max_tokens: the a + 1 tokens emitted are at most the tokens left.
        return min(most, req.max_tokens - req.num_output_tokens - 1)

    def scheduled(self, batch: ScheduledBatch) -> None:
        """Drop the drafts the schedule did not take whole (preempted or cut requests); the
        scheduler itself shortens a draft the step's budget or free pages cannot hold."""
        if not self._drafted:
            return
        fed = dict(zip(batch.requests, batch.query_lens, strict=True))
        for req in self._drafted:
            if fed.get(req) != 1 + len(req.draft):
                clear_draft(req)
        self._drafted = [r for r in self._drafted if r.draft]
        batch.drafts = bool(self._drafted)

    def accept(self, sampled: Sampled, batch: ScheduledBatch, computed: list[int]) -> list[Sampled]:
        """Acceptance of a step's verified rows. Returns the rows to append in rounds: round
        j holds each request's (j+1)-th token of this step, so appending round after round
        stops a request exactly where decoding without speculation stops it. Verified
        requests' computed tokens drop by their rejected proposals (in `computed` too)."""
        rows_of: dict[Request, list[int]] = {}
        rounds: list[list[int]] = [[]]
        requests = list(sampled.requests)
        for row, view in enumerate(sampled.requests):
            req = sampled.verifying.get(view)
            if req is None:
                rounds[0].append(row)
            else:
                rows_of.setdefault(req, []).append(row)
        for req, rows in rows_of.items():
            if req.is_finished:  # ended between launch and collect: nothing to append
                clear_draft(req)
                continue
            kept = self._verify(req, [sampled.token_ids[r] for r in rows])
            for j, row in enumerate(rows[: kept + 1]):
                if j == len(rounds):
                    rounds.append([])
                rounds[j].append(row)
                requests[row] = req
        self._drafted = []
        for i, req in enumerate(batch.requests):
            if req in rows_of:
                computed[i] = req.num_computed_tokens
        whole = Sampled(
            requests,
            sampled.token_ids,
            sampled.logprobs,
            sampled.top_ids,
            sampled.top_logprobs,
            sampled.prompt_scores,
            sampled.support,
            sampled.routed_experts,
            sampled.prompt_routing,
        )
        firsts = whole.rows(sorted(rounds[0]))
        return [firsts] + [_without_prompt(whole.rows(sorted(r))) for r in rounds[1:]]

    def _verify(self, req: Request, tokens: list[int]) -> int:
        """Count the proposals kept (each equal to the token sampled before it), roll the
        computed tokens back past the others, and clear the draft."""
        draft = req.draft
        kept = 0
        while kept < len(draft) and tokens[kept] == draft[kept]:
            kept += 1
        req.num_computed_tokens -= len(draft) - kept
        req.spec_proposed += len(draft)
        req.spec_accepted += kept
        self.proposed_tokens += len(draft)
        self.accepted_tokens += kept
        self._acceptance.setdefault(req, Acceptance()).record(kept, len(draft))
        clear_draft(req)
        return kept

    def given_back(self, batch: ScheduledBatch) -> None:
        """The step was given back before it ran (engine/core/step_loop.py): no draft stays."""
        for req in batch.requests:
            clear_draft(req)
        self._drafted = []

    def finished(self, req: Request) -> None:
        """`req` ended: the proposer and the acceptance estimates forget it."""
        clear_draft(req)
        self._acceptance.pop(req, None)
        self.proposer.finished(req)


def clear_draft(req: Request) -> None:
    if req.draft:
        req.draft = []
        if req.grammar is not None:
            req.grammar.draft_masks = []


def _without_prompt(sampled: Sampled) -> Sampled:
    sampled.prompt_scores, sampled.prompt_routing = [], []
    return sampled
