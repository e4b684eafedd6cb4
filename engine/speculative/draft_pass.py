"""DraftPass: one batched forward of the draft model over its sequences, returning the greedy
next token of each sequence that reaches the end of its tokens.

The step inputs are built as the target's are (engine/execution/step_inputs.py: the same
StepInputs buffers, fill_decode / fill_packed, forward_inputs' AttentionMetadata) from the
draft's own BlockTable; the pass runs eagerly (no CUDA graphs in this first version) and ends
with one device-to-host copy, of the proposed ids, which the next pass feeds.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from engine.execution.kv_group_inputs import fill_groups, group_caches
from engine.execution.step_inputs import StepInputs, fill_decode, fill_packed, forward_inputs
from engine.kv_cache.block_table import BlockTable
from engine.speculative.draft_model import DraftModel
from engine.speculative.draft_seq import DraftSeq


class DraftPass:
    def __init__(self, draft: DraftModel, max_seqs: int, max_tokens: int) -> None:
        """At most `max_seqs` sequences and `max_tokens` tokens a pass."""
        self.model, self.pool = draft.model, draft.pool
        self.device = draft.pool.device
        self.page_size = self.pool.page_size
        self.max_seqs, self.max_tokens = max_seqs, max(max_tokens, max_seqs)
        max_pages = self.pool.pages_for(draft.max_model_len)
        self.num_groups = groups = self.pool.groups.num_groups
        self.table = BlockTable(max_seqs, max_pages, groups)
        self.kv_caches = group_caches(self.pool)
        sizes = (self.max_tokens, max_seqs, max_pages, max_seqs)
        on_cpu = self.device.type == "cpu"
        self.host = StepInputs.allocate(*sizes, torch.device("cpu"), not on_cpu, groups)
        self.arrays = self.host.numpy()
        # On the CPU the host buffers are the pass's tensors: nothing to copy.
        device_inputs = (
            StepInputs.allocate(*sizes, self.device, False, groups) if not on_cpu else None
        )
        self.inputs = device_inputs or self.host

    @torch.inference_mode()
    def run(self, seqs: list[DraftSeq], query_lens: list[int]) -> list[int | None]:
        """Feed `query_lens[i]` tokens of `seqs[i]` from its `num_computed_tokens` (whose
        pages cover them) and advance it; for each sequence whose tokens that reaches the
        end of, the argmax of the draft's logits at its last row (None for the others)."""
        num_seqs, num_tokens = len(seqs), sum(query_lens)
        assert num_seqs <= self.max_seqs and num_tokens <= self.max_tokens
        a, pages = self.arrays, self.table.pages
        slots = np.array([s.slot for s in seqs], dtype=np.int64)
        width = max([len(s.pages) for s in seqs])
        if num_tokens == num_seqs:
            fill_decode(a, self.page_size, seqs, pages, slots)
        else:
            fill_packed(a, self.page_size, seqs, query_lens, pages, slots)
        a.block_table(num_seqs, width)[...] = pages[slots, :width]
        if self.table.group_pages:  # the other KV groups' slots and tables
            fill_groups(a, self.page_size, self.table.group_pages, slots, query_lens, width)
        if self.inputs is not self.host:
            self.inputs.copy_from(self.host, num_tokens, num_seqs, num_seqs * width)
        ends = [
            s.num_computed_tokens + n == len(s.token_ids)
            for s, n in zip(seqs, query_lens, strict=True)
        ]
        rows = (a.query_start_loc[1 : num_seqs + 1] - 1)[np.array(ends)]
        ids, positions, meta = forward_inputs(self.inputs, a, num_tokens, num_seqs, width)
        hidden = self.model(ids, positions, meta, self.kv_caches)  # [tokens, hidden]
        proposed: Iterator[int] = iter([])
        if len(rows):
            picked = torch.from_numpy(rows.astype(np.int64)).to(self.device)
            logits = self.model.compute_logits(hidden[picked])  # [ending seqs, vocab]
            proposed = iter(logits.argmax(dim=-1).tolist())  # the pass's one sync
        elif self.device.type == "cuda":
            # NOTE: the next pass refills the host buffers this one's uploads read.
            torch.cuda.current_stream(self.device).synchronize()
        for seq, n in zip(seqs, query_lens, strict=True):
            seq.num_computed_tokens += n
        return [next(proposed) if end else None for end in ends]
