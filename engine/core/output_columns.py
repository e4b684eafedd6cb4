"""OutputColumns: what one engine step produced, as columns, read as a list of RequestOutputs.

Postprocessing records a step's sampled rows as columns (the request, its token, its output
count after the token) instead of building an object per row; a RequestOutput is built for a
row only when something reads the sequence (all of them at once, on first access). A row
whose request ended this step, and every output produced outside the step (aborts, errors),
is built at once: its values are final.

What a lazily built output holds is the step's, not the read's: the output count and policy
version are recorded at the step, and the rest (ids, prompt length, cached tokens) never
change over a request's life. Pickling sends the built list. NOTE: a row whose request runs
a LoRA adapter reports its adapter's version when the output is built, and a CONTINUE replace
of the adapter (engine/lora/adapter_update.py) changes it: read a step's outputs before one
(the process loop publishes them within the step).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from engine.core.request_output import request_output
from engine.protocol.messages import PromptLogprobs, RequestOutput, TokenColumns
from engine.scheduling.request import Request

if TYPE_CHECKING:
    from engine.execution.launched_step import Sampled


class OutputColumns(Sequence[RequestOutput]):
    def __init__(
        self,
        first: list[RequestOutput],
        sampled: Sampled,
        counts: list[int],
        policy_version: int,
        speculative: bool = False,
    ) -> None:
        self.first = first  # outputs ahead of the rows: made outside the step
        # The engine speculates: a row of a request proposed for carries its counts so far
        # (RequestOutput.spec_tokens), read at the step as the rest is.
        self.speculative = speculative
        self.requests = sampled.requests  # one per sampled row
        self.token_ids = sampled.token_ids
        self.counts = counts  # completion tokens after this step's token
        self.policy_version = policy_version
        self.built: dict[int, RequestOutput] = {}  # rows built already (ended, or see below)
        self.prompt: dict[int, PromptLogprobs] = {}  # rows whose first output carries them
        self.logprobs = sampled.logprobs
        self.top_ids = sampled.top_ids
        self.top_logprobs = sampled.top_logprobs
        self.support = sampled.support
        self.routed = sampled.routed_experts
        self._list: list[RequestOutput] | None = None

    def build_final(self, row: int) -> None:
        """Build row `row`'s output now: its request just ended (finish reason, metrics)."""
        req = self.requests[row]
        lp, top = self.row_logprobs(req, row)
        out = request_output(req, [self.token_ids[row]], lp, top, self.policy_version)
        out.prompt_logprobs = self.prompt.get(row)
        out.sampling_support = self.row_support(req, row)
        out.routed_experts = self.row_routed(req, row)
        self.built[row] = out

    def attach_prompt(self, row: int, prompt_logprobs: PromptLogprobs) -> None:
        """Row `row` is its request's first output: it carries the prompt's logprobs."""
        self.prompt[row] = prompt_logprobs
        self.built[row] = self.row_output(row)

    def row_output(self, row: int) -> RequestOutput:
        """The RequestOutput of sampled row `row` (building it if needed)."""
        out = self.built.get(row)
        if out is not None:
            return out
        req = self.requests[row]
        lp, top = self.row_logprobs(req, row)
        return RequestOutput(
            req.request_id,
            req.index,
            [self.token_ids[row]],
            req.adapter_version or self.policy_version,
            lp,
            top,
            None,
            None,
            req.prompt_len,
            req.num_cached_tokens,
            self.counts[row],
            prompt_logprobs=self.prompt.get(row),
            sampling_support=self.row_support(req, row),
            routed_experts=self.row_routed(req, row),
            spec_tokens=(req.spec_proposed, req.spec_accepted) if req.spec_proposed else None,
        )

    def row_logprobs(
        self, req: Request, row: int
    ) -> tuple[list[float] | None, list[tuple[list[int], list[float]]] | None]:
        """What row `row` (of `req`) reports of the logprobs sampled: what it asked for."""
        lp = None
        if req.params.logprobs and self.logprobs is not None:
            lp = [self.logprobs[row]]
        top = None
        k = req.params.top_logprobs
        if k and self.top_ids is not None and self.top_logprobs is not None:
            top = [(self.top_ids[row][:k], self.top_logprobs[row][:k])]
        return lp, top

    def row_support(self, req: Request, row: int) -> list[list[int]] | None:
        """Row `row`'s sampling support, if its request asked for it."""
        if not req.params.sampling_support or self.support is None:
            return None
        return [self.support[row] or []]  # (an overflow ends the request: Postprocessor)

    def row_routed(self, req: Request, row: int) -> list[list[int]] | None:
        """Row `row`'s routed experts, if its request asked for them."""
        if not req.params.routed_experts or self.routed is None:
            return None
        return [self.routed[row]]

    def outputs(self) -> list[RequestOutput]:
        """Every output as a list, built once."""
        if self._list is None:
            if self.logprobs is None and self.routed is None:
                version = self.policy_version
                rows = [
                    RequestOutput(
                        r.request_id,
                        r.index,
                        [t],
                        r.adapter_version or version,
                        None,
                        None,
                        None,
                        None,
                        r.prompt_len,
                        r.num_cached_tokens,
                        c,
                    )
                    for r, t, c in zip(self.requests, self.token_ids, self.counts, strict=True)
                ]
                for row, out in self.built.items():
                    rows[row] = out
                if self.speculative:
                    for out, r in zip(rows, self.requests, strict=True):
                        if r.spec_proposed and out.spec_tokens is None:
                            out.spec_tokens = (r.spec_proposed, r.spec_accepted)
            else:
                rows = [self.row_output(row) for row in range(len(self.requests))]
            self._list = self.first + rows
        return self._list

    def for_pipe(self) -> tuple[list[RequestOutput], TokenColumns]:
        """(outputs to send as objects, the plain rows as columns): what the engine process
        sends instead of an object per row. The objects are `first`, the rows that ended and
        the rows with logprobs or routed experts; the service reads them all with
        StepOutput.all_outputs()."""
        objects = list(self.first)
        plain: list[int] = []
        for row, req in enumerate(self.requests):
            if row in self.built or self._rich(req):
                objects.append(self.row_output(row))
            else:
                plain.append(row)
        reqs, tokens, counts = self.requests, self.token_ids, self.counts
        if len(plain) < len(reqs):
            reqs = [reqs[i] for i in plain]
            tokens = [tokens[i] for i in plain]
            counts = [counts[i] for i in plain]
        columns = TokenColumns(
            [r.request_id for r in reqs],
            [r.index for r in reqs],
            tokens,
            [r.prompt_len for r in reqs],
            [r.num_cached_tokens for r in reqs],
            counts,
            self.policy_version,
        )
        return objects, columns

    def _rich(self, req: Request) -> bool:
        """Whether `req`'s row reports more than its token, its adapter's version (the
        columns carry one version for all) or its speculative counts: sent as an object."""
        if req.adapter_version or (self.speculative and req.spec_proposed):
            return True
        if self.logprobs is not None and _wants_logprobs(req):
            return True
        return self.routed is not None and req.params.routed_experts

    def __len__(self) -> int:
        return len(self.first) + len(self.requests)

    @overload
    def __getitem__(self, index: int) -> RequestOutput: ...
    @overload
    def __getitem__(self, index: slice) -> list[RequestOutput]: ...
    def __getitem__(self, index: int | slice) -> RequestOutput | list[RequestOutput]:
        return self.outputs()[index]

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self.outputs())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OutputColumns):
            return self.outputs() == other.outputs()
        if isinstance(other, list):
            return self.outputs() == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"OutputColumns({self.outputs()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (self.outputs(),)


def _wants_logprobs(req: Request) -> bool:
    p = req.params
    return p.logprobs or p.top_logprobs > 0 or p.sampling_support
