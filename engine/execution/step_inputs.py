"""The flat input tensors of one step, allocated once at the largest step.

The model runner fills a host copy (pinned on CUDA, through numpy views) and copies the used
prefix of each tensor to the device without blocking; the CUDA graph runner keeps a device
copy of its own whose addresses never change, because its captured graphs read them.

With several KV groups (engine/kv_cache/kv_groups.py) groups 1.. have their own slot mappings
and block tables, in `group_slots` and `group_tables` (one row per group, the same layouts as
`slot_mapping` and `block_tables`); with one group they are empty.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata


class StepRow(Protocol):
    """What filling a step needs of one of its sequences (a Request; the draft model's
    sequences, engine/speculative/draft_seq.py): its tokens and how many have KV."""

    token_ids: list[int]
    num_computed_tokens: int

    def input_id(self, position: int) -> int: ...

    def input_ids(self, start: int, count: int) -> list[int]: ...


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    seq_lens: torch.Tensor  # [max_seqs] int32: context length after the step
    query_start_loc: torch.Tensor  # [max_seqs + 1] int32
    block_tables: torch.Tensor  # [max_seqs * max_pages] int32, a step views [seqs, width]
    # (see block_table(): row-major for eager steps, page-major for graphed ones)
    # [max_rows + max_tokens] int64: the token index of each sampled row's logits, then of
    # each prompt-scored row's (at most one per token)
    sample_rows: torch.Tensor
    sampling_floats: torch.Tensor  # [max_rows, 6] float32: SamplingBatch.floats' columns
    sampling_ints: torch.Tensor  # [max_rows, 5] int64: SamplingBatch.ints' columns
    group_slots: torch.Tensor  # [groups - 1, max_tokens] int64
    group_tables: torch.Tensor  # [groups - 1, max_seqs * max_pages] int32

    @classmethod
    def allocate(
        cls,
        max_tokens: int,
        max_seqs: int,
        max_pages: int,
        max_rows: int,
        device: torch.device,
        pin: bool = False,
        num_groups: int = 1,
    ) -> StepInputs:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(
            input_ids=zeros(max_tokens),
            positions=zeros(max_tokens),
            slot_mapping=zeros(max_tokens),
            seq_lens=zeros(max_seqs, dtype=torch.int32),
            query_start_loc=zeros(max_seqs + 1, dtype=torch.int32),
            block_tables=zeros(max_seqs * max_pages, dtype=torch.int32),
            sample_rows=zeros(max_rows + max_tokens),
            sampling_floats=zeros(max_rows, 6, dtype=torch.float32),
            sampling_ints=zeros(max_rows, 5),
            group_slots=zeros(num_groups - 1, max_tokens),
            group_tables=zeros(num_groups - 1, max_seqs * max_pages, dtype=torch.int32),
        )

    def numpy(self) -> StepArrays:
        """Numpy views of these (host) tensors: fast to fill from Python lists."""
        return StepArrays(**{f.name: getattr(self, f.name).numpy() for f in fields(self)})

    def block_table(self, num_seqs: int, width: int, page_major: bool = False) -> torch.Tensor:
        """The [num_seqs, width] block table at the front of the buffer.

        Page-major (a graphed step's layout) puts entry (i, j) at j * num_seqs + i: the first
        w pages of every row are then one contiguous prefix of w * num_seqs entries, so a step
        copies only the pages its sequences have, not the full width the graph was captured at.
        """
        return _table(self.block_tables, num_seqs, width, page_major)

    def group_metas(
        self, meta: AttentionMetadata, num_tokens: int, width: int, page_major: bool = False
    ) -> None:
        """Give `meta` (group 0's) the metadata of groups 1.. over these buffers."""
        num_seqs = meta.num_seqs
        meta.groups = [
            meta.with_tables(slots[:num_tokens], _table(tables, num_seqs, width, page_major))
            for slots, tables in zip(self.group_slots, self.group_tables, strict=True)
        ]

    def copy_from(
        self, src: StepInputs, num_tokens: int, num_seqs: int, table_entries: int
    ) -> None:
        """Copy the model inputs a step uses (prefixes); non-blocking from pinned memory.

        NOTE: the source must not be refilled until the device has read it (the model runner
        records an event after its uploads and waits on it before the next step's fill).
        """
        sizes = {
            "input_ids": num_tokens,
            "positions": num_tokens,
            "slot_mapping": num_tokens,
            "seq_lens": num_seqs,
            "query_start_loc": num_seqs + 1,
            "block_tables": table_entries,
        }
        for name, size in sizes.items():
            getattr(self, name)[:size].copy_(getattr(src, name)[:size], non_blocking=True)
        if self.group_slots.shape[0]:
            self.group_slots[:, :num_tokens].copy_(src.group_slots[:, :num_tokens], True)
            self.group_tables[:, :table_entries].copy_(src.group_tables[:, :table_entries], True)


@dataclass
class StepArrays:
    """StepInputs seen as numpy arrays (same memory)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    block_tables: np.ndarray
    sample_rows: np.ndarray
    sampling_floats: np.ndarray
    sampling_ints: np.ndarray
    group_slots: np.ndarray
    group_tables: np.ndarray

    def block_table(self, num_seqs: int, width: int, page_major: bool = False) -> np.ndarray:
        """StepInputs.block_table as a numpy view."""
        return _array_table(self.block_tables, num_seqs, width, page_major)

    def group_table(
        self, group: int, num_seqs: int, width: int, page_major: bool = False
    ) -> np.ndarray:
        """Group `group`'s (1..) block table, as block_table."""
        return _array_table(self.group_tables[group - 1], num_seqs, width, page_major)


def _table(flat: torch.Tensor, num_seqs: int, width: int, page_major: bool) -> torch.Tensor:
    flat = flat[: num_seqs * width]
    return flat.view(width, num_seqs).t() if page_major else flat.view(num_seqs, width)


def _array_table(flat: np.ndarray, num_seqs: int, width: int, page_major: bool) -> np.ndarray:
    flat = flat[: num_seqs * width]
    return flat.reshape(width, num_seqs).T if page_major else flat.reshape(num_seqs, width)


def forward_inputs(
    inputs: StepInputs, arrays: StepArrays, num_tokens: int, num_seqs: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """An eager step's (input ids, positions, attention metadata): views of `inputs` (the
    device's), lengths read from `arrays` (the host's; the same buffers on the CPU)."""
    starts = arrays.query_start_loc[: num_seqs + 1]
    query_lens = (starts[1:] - starts[:-1]).tolist()
    context_lens = arrays.seq_lens[:num_seqs].tolist()
    meta = AttentionMetadata(
        query_lens=query_lens,
        context_lens=context_lens,
        slot_mapping=inputs.slot_mapping[:num_tokens],
        block_tables=inputs.block_table(num_seqs, width),
        seq_lens=inputs.seq_lens[:num_seqs],
        query_start_loc=inputs.query_start_loc[: num_seqs + 1],
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        decode_only=num_tokens == num_seqs,
    )
    if inputs.group_slots.shape[0]:
        inputs.group_metas(meta, num_tokens, width)
    return inputs.input_ids[:num_tokens], inputs.positions[:num_tokens], meta


def fill_decode(
    a: StepArrays, size: int, reqs: Sequence[StepRow], pages: np.ndarray, slots: np.ndarray
) -> None:
    """A decode step's inputs (one token per sequence) into `a`, for pages of `size` tokens:
    two list comprehensions, the rest in numpy. `pages`: the block table's rows, `slots`:
    each request's row."""
    num_seqs = len(reqs)
    try:
        a.input_ids[:num_seqs] = [r.token_ids[r.num_computed_tokens] for r in reqs]
    except IndexError:  # a pending token (overlapped steps): the device writes its id
        a.input_ids[:num_seqs] = [r.input_id(r.num_computed_tokens) for r in reqs]
    positions = a.positions[:num_seqs]
    positions[:] = [r.num_computed_tokens for r in reqs]
    # int64 before the multiply: page * page_size may pass int32 in a large pool.
    page = pages[slots, positions // size].astype(np.int64)
    a.slot_mapping[:num_seqs] = page * size + positions % size
    np.add(positions, 1, out=a.seq_lens[:num_seqs], casting="unsafe")
    a.query_start_loc[: num_seqs + 1] = np.arange(num_seqs + 1)


def fill_packed(
    a: StepArrays,
    size: int,
    reqs: Sequence[StepRow],
    query_lens: list[int],
    pages: np.ndarray,
    slots: np.ndarray,
) -> None:
    """Any mix of prefill chunks and decodes: every token's position and slot in numpy."""
    num_seqs = len(reqs)
    starts = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
    lens = np.asarray(query_lens, dtype=np.int64)
    num_tokens = int(lens.sum())
    a.query_start_loc[0] = 0
    np.cumsum(lens, out=a.query_start_loc[1 : num_seqs + 1])
    seq = np.repeat(np.arange(num_seqs), lens)  # each token's sequence
    first = a.query_start_loc[:num_seqs].astype(np.int64)
    positions = starts[seq] + np.arange(num_tokens) - first[seq]
    spans = list(zip(reqs, starts.tolist(), query_lens, strict=True))
    ids = list(itertools.chain.from_iterable(r.token_ids[s : s + n] for r, s, n in spans))
    if len(ids) < num_tokens:  # pending tokens (overlapped steps): the device writes them
        ids = list(itertools.chain.from_iterable(r.input_ids(s, n) for r, s, n in spans))
    a.input_ids[:num_tokens] = ids
    a.positions[:num_tokens] = positions
    page = pages[slots[seq], positions // size].astype(np.int64)  # int64: see fill_decode
    a.slot_mapping[:num_tokens] = page * size + positions % size
    a.seq_lens[:num_seqs] = starts + lens
