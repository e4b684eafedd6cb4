"""DraftProposer: `--speculative-method draft`, a smaller checkpoint with the target's tokenizer
proposing each request's next tokens by greedy decoding.

Per request the draft keeps a DraftSeq (draft_seq.py) whose KV, in the draft's own pool
(draft_model.py), covers a prefix of the request's tokens. A `propose` call:

1. syncs each request's DraftSeq with its tokens: the KV of the proposals the target accepted
   stays, the rest is recomputed over the same pages;
2. gives each its pages for the positions it will feed, evicting the KV of the least recently
   used sequences that are not in the call when the pool is short, and proposing nothing for a
   request it still cannot hold (the request decodes without speculation, nothing fails);
3. runs batched passes (draft_pass.py): the first catches every sequence up on the tokens it
   has not computed (a chunked prefill, `max_tokens` a pass) and proposes from its last row;
   each further pass feeds every sequence's newest proposal (one decode token) and proposes
   the next, until each has its `limit`.

A proposal is the argmax of the draft's raw logits: the request's logit transforms
(temperature, penalties, bias, allowed or bad tokens, grammar) are not applied to the draft. A
proposal the target would never emit is just rejected by verification; it costs acceptance,
never correctness.

A weight update may set the draft's tensors too, named `draft.` + the draft checkpoint's names
(engine/weights/update_target.py); after any update every sequence's KV is recomputed. A
draft an update leaves alone proposes less well as the policy drifts from it: its acceptance
falls, and the engine turns speculation off for a request whose acceptance stays low.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache.page_pool import PagePool
from engine.protocol.config import EngineConfig
from engine.scheduling.request import Request
from engine.speculative.draft_model import DraftModel
from engine.speculative.draft_pass import DraftPass, pass_sizes
from engine.speculative.draft_seq import DraftSeq


class DraftProposer:
    method = "draft"

    def __init__(self, draft: DraftModel, max_seqs: int, max_tokens: int) -> None:
        """`max_seqs` sequences and `max_tokens` tokens a forward pass, at most."""
        self.draft = draft
        self.pool: PagePool = draft.pool
        self.passes = DraftPass(draft, max_seqs, max_tokens)
        # Least recently proposed for first: the order evictions take them in.
        self.seqs: dict[tuple[str, int], DraftSeq] = {}

    def propose(self, reqs: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """The draft's greedy continuation of each request, `limits[i]` tokens (fewer near the
        draft's context's end; none for a request its pool cannot hold)."""
        out: list[list[int]] = [[] for _ in reqs]
        keep = {r.key for r in reqs}  # not evicted to make room for one another
        work: list[tuple[int, DraftSeq, int]] = []  # (index in reqs, its sequence, limit)
        for i, (req, limit) in enumerate(zip(reqs, limits, strict=True)):
            # Its positions stay below the draft's context: the last one fed is the
            # (limit - 1)-th proposal's.
            limit = min(limit, self.draft.max_model_len + 1 - len(req.token_ids))
            if limit < 1 or not req.token_ids:
                continue
            seq = self.seqs.pop(req.key, None) or self._new_seq(req.key)
            self.seqs[req.key] = seq  # now the most recently used
            seq.sync(req.token_ids)
            if self._hold(seq, seq.known + limit - 1, keep):
                work.append((i, seq, limit))
        while work:
            batch, lens = self._next_pass(work)
            for (i, seq, _), token in zip(work, self.passes.run(batch, lens), strict=False):
                if token is not None:
                    seq.token_ids.append(token)
                    out[i].append(token)
            work = [w for w in work if len(out[w[0]]) < w[2]]
        return out

    def _next_pass(self, work: list[tuple[int, DraftSeq, int]]) -> tuple[list[DraftSeq], list[int]]:
        """The sequences of the next pass (a prefix of `work`) and the tokens each feeds: all
        it has not computed, within the pass's token budget."""
        budget, batch, lens = self.passes.max_tokens, [], []
        for _, seq, _ in work[: self.passes.max_seqs]:
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if n == 0:
                break
            batch.append(seq)
            lens.append(n)
            budget -= n
        assert batch, "every sequence at work has a token to feed"
        return batch, lens

    def _hold(self, seq: DraftSeq, num_tokens: int, keep: set[tuple[str, int]]) -> bool:
        """Give `seq` pages for `num_tokens` positions; False when the pool cannot, even after
        evicting every sequence outside `keep`."""
        missing = self.pool.pages_for(num_tokens) - len(seq.pages)  # logical pages
        ids = missing * self.passes.num_groups  # a page id in every KV group for each
        if ids > self.pool.num_free:
            for key in [k for k in self.seqs if k not in keep]:
                self._free(self.seqs.pop(key))
                if ids <= self.pool.num_free:
                    break
        if ids > self.pool.num_free:
            return False
        if missing > 0:
            for pages in [seq.pages, *seq.group_pages]:
                pages += [self.pool.take_free() for _ in range(missing)]
            if seq.slot is None:
                self.passes.table.assign(seq)
            else:
                self.passes.table.extend(seq)
        return True

    def finished(self, req: Request) -> None:
        seq = self.seqs.pop(req.key, None)
        if seq is not None:
            self._free(seq)

    def weights_updated(self) -> None:
        """A weight update may have set the draft's tensors too (engine/weights/
        update_target.py): every sequence's KV is dropped, recomputed at its next proposal."""
        for key in list(self.seqs):
            self._free(self.seqs.pop(key))

    def _new_seq(self, key: tuple[str, int]) -> DraftSeq:
        return DraftSeq(key, group_pages=[[] for _ in range(self.passes.num_groups - 1)])

    def _free(self, seq: DraftSeq) -> None:
        for pages in [seq.pages, *seq.group_pages]:
            for page in pages:
                if self.pool.release(page):
                    self.pool.put_free(page)
            pages.clear()
        self.passes.table.release(seq)


def draft_proposer(config: EngineConfig, draft: DraftModel) -> DraftProposer:
    """Rank 0's proposer over its (shard of the) draft model, its passes as large as a step."""
    return DraftProposer(draft, *pass_sizes(config))
