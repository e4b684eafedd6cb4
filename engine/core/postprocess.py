"""Postprocessing a step's samples: what they do to their requests, and the outputs they make.

The prompt positions scored are recorded (a request that only scores its prompt, max_tokens 0,
ends once it is scored); structured-output rows advance their grammars (a token a grammar
refuses ends its request); n > 1 siblings fork before any token is appended; the sampled tokens
are appended and the requests they stop end; a request's first output carries its prompt
logprobs; a sampling support the sampler could not list ends its request. The RequestTable
owns the requests and ends them; the Postprocessor counts the tokens it appends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.core.output_columns import OutputColumns
from engine.core.request_output import stop_reason
from engine.core.request_table import RequestTable
from engine.execution.launched_step import Sampled
from engine.kv_cache.prefix_cache import PrefixCache
from engine.protocol.messages import SUPPORT_TIES, FinishReason, RequestOutput
from engine.sampling.sampler import NO_TOKEN
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import Scheduler


class Postprocessor:
    """Applies a step's samples to their requests (which the RequestTable owns and ends)."""

    def __init__(
        self, table: RequestTable, scheduler: Scheduler, cache: PrefixCache, eos: Sequence[int]
    ) -> None:
        self.table = table
        self.scheduler = scheduler
        self.cache = cache
        self.eos = eos
        self.tokens_generated = 0  # sampled tokens appended, ever

    def append_sampled(self, sampled: Sampled, first: list[RequestOutput]) -> OutputColumns:
        """Record the prompt positions scored; append each row's token, end the requests it
        stops; outputs as OutputColumns (a request's first output carries its prompt logprobs)."""
        for req, position, routed in sampled.prompt_routing:  # before a scored request ends
            if req.prompt_scores is not None and not req.is_finished:
                req.prompt_scores.record_routing(position, routed)
        for req, position, rows in sampled.prompt_scores:
            if req.prompt_scores is not None and not req.is_finished:
                req.prompt_scores.record(position, rows)
                if req.max_tokens == 0 and req.prompt_scores.complete:
                    self.table.end_scored(req, first)
        if NO_TOKEN in sampled.token_ids:
            sampled = self._end_impossible(sampled, first)
        if any(
            [r.grammar is not None for r in sampled.requests]
        ):  # a list: faster than a generator
            sampled = self._advance_grammars(sampled, first)
        reqs, tokens = sampled.requests, sampled.token_ids
        # NOTE: siblings fork before any token is appended: a leader that stops at its first
        # token releases the prompt pages they start from.
        for req in [r for r in reqs if r.status is RequestStatus.FORK_PENDING]:
            self.scheduler.fork(req, self.table.requests[req.request_id][0])
        for req, token in zip(reqs, tokens, strict=True):
            req.token_ids.append(token)
        self.tokens_generated += len(reqs)
        now = time.monotonic()
        firsts = [row for row, r in enumerate(reqs) if r.first_token_time is None]
        for row in firsts:
            reqs[row].first_token_time = now
        counts = [len(r.token_ids) - r.prompt_len for r in reqs]
        eos = self.eos
        # Rows that may stop (stop_reason decides): an EOS id, stop ids to check, the length.
        maybe = [
            row
            for row, (r, t, c) in enumerate(zip(reqs, tokens, counts, strict=True))
            if c >= r.max_tokens or t in eos or r.params.stop_token_ids or r.grammar is not None
        ]
        version, speculative = self.table.policy_version, self.scheduler.speculative
        outputs = OutputColumns(first, sampled, counts, version, speculative)
        for row in firsts:
            scores, reqs[row].prompt_scores = reqs[row].prompt_scores, None
            if scores is not None:
                outputs.attach_prompt(row, scores.result())
        for row in maybe:
            reason = stop_reason(reqs[row], tokens[row], eos)
            if reason is not None:
                self.table.finish(reqs[row], reason, None)
                outputs.build_final(row)  # its values are final now
        if sampled.support is not None and None in sampled.support:
            self._end_unlisted_supports(sampled, outputs)
        return outputs

    def _end_impossible(self, sampled: Sampled, first: list[RequestOutput]) -> Sampled:
        """A row whose every token's logit was -inf sampled NO_TOKEN: its request ends with ERROR
        and nothing is appended; the other rows go on."""
        impossible = [row for row, token in enumerate(sampled.token_ids) if token == NO_TOKEN]
        for row in impossible:
            req = sampled.requests[row]
            message = (
                "no token is possible: every token's logit is -inf after "
                f"{' and '.join(masking_options(req)) or 'the logits'} "
                f"(at output token {req.num_output_tokens})"
            )
            if req.params.structured is not None:  # the grammar's own wording (docs/service.md)
                message = _no_continuation(req)
            self.table.end(req, FinishReason.ERROR, message, first)
        return sampled.rows([row for row in range(len(sampled.requests)) if row not in impossible])

    def _advance_grammars(self, sampled: Sampled, first: list[RequestOutput]) -> Sampled:
        """Each constrained row's token advances its grammar. A token the grammar refuses ends its
        request with ERROR and is dropped; the other rows go on. (A mask that allowed nothing
        sampled NO_TOKEN: `_end_impossible` ended that request already.)"""
        refused = [
            row
            for row, (req, token) in enumerate(
                zip(sampled.requests, sampled.token_ids, strict=True)
            )
            if req.grammar is not None and not req.grammar.accept(token)
        ]
        for row in refused:
            req = sampled.requests[row]
            self.table.end(req, FinishReason.ERROR, _no_continuation(req), first)
        if not refused:
            return sampled
        return sampled.rows([row for row in range(len(sampled.requests)) if row not in refused])

    def _end_unlisted_supports(self, sampled: Sampled, outputs: OutputColumns) -> None:
        """A support the sampler could not list (more than SUPPORT_TIES tokens tie at the k-th
        logit) ends its request: it would be wrong, not short."""
        assert sampled.support is not None
        for row, req in enumerate(sampled.requests):
            listed = sampled.support[row] is not None
            if not listed and req.params.sampling_support and not req.is_finished:
                message = f"sampling_support: more than {SUPPORT_TIES} tokens tie at top_k"
                self.table.finish(req, FinishReason.ERROR, message)
                outputs.build_final(row)

    def publish_pages(self, reqs: list[Request], computed: list[int]) -> None:
        """Publish to the prefix cache the full pages of each request's first `computed` tokens,
        as far as they are computed and known on the host (an overlapped step's pending tokens are
        not)."""
        cache = self.cache
        if not cache.enabled:
            return
        size = cache.pool.page_size
        for req, num_tokens in zip(reqs, computed, strict=True):
            # Only a request whose step filled a page has anything to publish.
            if num_tokens // size <= len(req.page_hashes) or not req.publish_pages:
                continue
            if req.status is RequestStatus.RUNNING:
                num_tokens = min(num_tokens, req.num_computed_tokens, len(req.token_ids))
                pages, hashes = req.pages, req.page_hashes
                version, adapter = self.table.policy_version, req.adapter_key
                groups = req.group_pages
                cache.publish(version, req.token_ids, pages, num_tokens, hashes, adapter, groups)


def masking_options(req: Request) -> list[str]:
    """The request's options that can set a token's logit to -inf, by their field names."""
    params = req.params
    names = [
        name
        for name, used in (
            ("allowed_token_ids", params.allowed_token_ids),
            ("logit_bias", params.logit_bias),
            ("bad_token_ids", params.bad_token_ids),
            ("bad_words", params.bad_word_ids),
            ("min_tokens", params.min_tokens and req.num_output_tokens < params.min_tokens),
        )
        if used
    ]
    if params.structured is not None:
        names.append(params.structured.field)
    return names


def _no_continuation(req: Request) -> str:
    assert req.params.structured is not None
    return (
        f"{req.params.structured.field}: no token can continue the text after "
        f"{req.num_output_tokens} tokens"
    )
