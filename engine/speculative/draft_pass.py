"""DraftPass: one batched forward of the draft model over its sequences, returning the greedy
next token of each sequence that reaches the end of its tokens; DraftFollower: the same pass on
another tensor-parallel rank's shard of the draft.

The step inputs are built as the target's are (engine/execution/step_inputs.py: the same
StepInputs buffers, fill_decode / fill_packed, forward_inputs' AttentionMetadata) from the
draft's own BlockTable; the pass runs eagerly (no CUDA graphs in this first version) and ends
with one device-to-host copy, of the proposed ids, which the next pass feeds.

Under tensor parallelism rank 0 fills the inputs and sends them, with the rows whose logits it
reads, through a StepChannel over the draft's buffers (a DRAFT message,
engine/parallel/step_channel.py); each other rank's DraftFollower receives them into its own
buffers and runs the same forward and logits on its shard, joining every collective.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.execution.kv_group_inputs import fill_groups, group_caches
from engine.execution.step_inputs import StepInputs, fill_decode, fill_packed, forward_inputs
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.page_pool import PagePool
from engine.models.hf_config import ModelConfig
from engine.parallel.step_channel import Op, StepChannel, StepHeader
from engine.parallel.tensor_parallel import TensorParallel
from engine.protocol.config import EngineConfig
from engine.speculative.draft_model import DraftModel, draft_config, load_draft
from engine.speculative.draft_seq import DraftSeq


def pass_sizes(config: EngineConfig) -> tuple[int, int]:
    """(sequences, tokens) of a draft pass at most: every rank's buffers are this size."""
    return config.max_num_seqs, max(config.max_num_batched_tokens, config.max_num_seqs)


class DraftForward:
    """The draft's step buffers and its forward over them, alike on every rank."""

    def __init__(self, draft: DraftModel, max_seqs: int, max_tokens: int) -> None:
        """At most `max_seqs` sequences and `max_tokens` tokens a pass."""
        self.model, self.pool = draft.model, draft.pool
        self.device = draft.pool.device
        self.max_seqs, self.max_tokens = max_seqs, max(max_tokens, max_seqs)
        self.max_pages = self.pool.pages_for(draft.max_model_len)
        self.num_groups = groups = self.pool.groups.num_groups
        self.kv_caches = group_caches(self.pool)
        sizes = (self.max_tokens, max_seqs, self.max_pages, max_seqs)
        on_cpu = self.device.type == "cpu"
        self.host = StepInputs.allocate(*sizes, torch.device("cpu"), not on_cpu, groups)
        self.arrays = self.host.numpy()
        # On the CPU the host buffers are the pass's tensors: nothing to copy.
        device_inputs = (
            StepInputs.allocate(*sizes, self.device, False, groups) if not on_cpu else None
        )
        self.inputs = device_inputs or self.host
        self.channel: StepChannel | None = None  # tensor parallel: rank 0 sends, others receive
        if self.model.tp.enabled:
            self.channel = StepChannel(self.model.tp, self.arrays, max_copies=0)

    def forward(self, h: StepHeader) -> torch.Tensor | None:
        """The pass `h` describes, its inputs in the host buffers: the draft's logits at the
        `h.num_rows` rows in `sample_rows` (None when there are none)."""
        num_tokens, num_seqs = h.num_tokens, h.num_seqs
        if self.inputs is not self.host:
            self.inputs.copy_from(self.host, num_tokens, num_seqs, num_seqs * h.width)
            rows = self.inputs.sample_rows[: h.num_rows]
            rows.copy_(self.host.sample_rows[: h.num_rows], non_blocking=True)
        ids, positions, meta = forward_inputs(
            self.inputs, self.arrays, num_tokens, num_seqs, h.width
        )
        hidden = self.model(ids, positions, meta, self.kv_caches)  # [tokens, hidden]
        if not h.num_rows:
            return None
        return self.model.compute_logits(hidden[self.inputs.sample_rows[: h.num_rows]])


class DraftPass(DraftForward):
    """Rank 0's: fills a pass's inputs from its sequences and reads the proposals."""

    def __init__(self, draft: DraftModel, max_seqs: int, max_tokens: int) -> None:
        super().__init__(draft, max_seqs, max_tokens)
        self.table = BlockTable(max_seqs, self.max_pages, self.num_groups)

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
            fill_decode(a, self.pool.page_size, seqs, pages, slots)
        else:
            fill_packed(a, self.pool.page_size, seqs, query_lens, pages, slots)
        a.block_table(num_seqs, width)[...] = pages[slots, :width]
        if self.table.group_pages:  # the other KV groups' slots and tables
            args = (self.table.group_pages, slots, query_lens, width)
            fill_groups(a, self.pool.page_size, *args)
        ends = [
            s.num_computed_tokens + n == len(s.token_ids)
            for s, n in zip(seqs, query_lens, strict=True)
        ]
        rows = (a.query_start_loc[1 : num_seqs + 1] - 1)[np.array(ends)]
        a.sample_rows[: len(rows)] = rows
        header = StepHeader(Op.DRAFT, num_tokens, num_seqs, width, num_rows=len(rows))
        if self.channel is not None:
            self.channel.send(header)
        logits = self.forward(header)
        proposed = iter(logits.argmax(dim=-1).tolist() if logits is not None else [])
        if logits is None and self.device.type == "cuda":  # the pass's one sync otherwise
            # NOTE: the next pass refills the host buffers this one's uploads read.
            torch.cuda.current_stream(self.device).synchronize()
        for seq, n in zip(seqs, query_lens, strict=True):
            seq.num_computed_tokens += n
        return [next(proposed) if end else None for end in ends]


class DraftFollower(DraftForward):
    """Another rank's: runs each pass rank 0 announces on its shard of the draft."""

    @torch.inference_mode()
    def follow(self, header: StepHeader) -> None:
        """The DRAFT `header` (received on the step channel): its inputs, then its pass."""
        assert self.channel is not None, "a follower is a rank of a tensor-parallel group"
        self.channel.receive_inputs(header)
        self.forward(header)
        if self.device.type == "cuda":  # NOTE: the next pass refills the buffers this one read
            torch.cuda.current_stream(self.device).synchronize()


def load_draft_follower(
    config: EngineConfig,
    target_dir: Path,
    target_cfg: ModelConfig,
    tp: TensorParallel,
    device: torch.device,
    dtype: torch.dtype,
    target_pool: PagePool,
) -> DraftFollower | None:
    """A worker rank's shard of the draft and its follower (None unless the method is
    `draft`), loaded where rank 0 loads its own: right after the target's shard."""
    if config.speculative_method != "draft":
        return None
    cfg = draft_config(config, target_dir, target_cfg)
    draft = load_draft(config, cfg, tp, device, dtype, target_pool.num_bytes)
    return DraftFollower(draft, *pass_sizes(config))
