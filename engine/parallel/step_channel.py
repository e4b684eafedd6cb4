"""StepChannel: what rank 0 tells the other tensor-parallel ranks, and how they hear it.

Every message starts with one broadcast of a fixed 10-int header (an Op and a step's sizes). A
STEP is followed by one more broadcast: the used prefixes of the step's int buffers (token ids,
positions, KV slots, sequence lengths, query starts, the block table, the sampled and
prompt-scored rows; with LoRA adapters in the step, each sequence's adapter slot) and the KV
page copies made since the last step (the partial prompt page an
n > 1 sibling forks), packed into one int64 tensor. So a step costs two small broadcasts on the control group, sized
by the step's tokens and pages, never by the model. Rank 0's page tables are the only ones:
workers see page ids, never requests. A LORA message (a slot written or cleared) is followed
by the adapter itself, broadcast as an object (engine/execution/model_runner.py `share_slot`).
A DRAFT is a pass of the speculative draft model (engine/speculative/draft_pass.py): its header
and inputs go through a channel of its own, over the draft's buffers, the same way a STEP's do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np
import torch

from engine.parallel.tensor_parallel import TensorParallel

HEADER_SIZE = 10


class Op(IntEnum):
    STEP = 1  # a forward: header sizes, then the packed inputs
    STAGE = 2  # a weight update's staging (engine/weights/sharded_update.py), then its verdict
    GATHER = 3  # send every parameter shard to rank 0 (live_weights)
    PING = 4  # nothing: keeps idle workers inside the collective timeout
    STOP = 5  # leave the group and exit
    JOIN = (
        6  # start joining (or leave) a trainer's weight-transfer group (weights/transfer_group.py)
    )
    LORA = 7  # write a LoRA adapter slot (engine/lora/adapter_slots.py), then its contents
    JOINED = 8  # rank 0's join settled: finish this rank's, and agree on the outcome
    DRAFT = 9  # a draft model's pass: header sizes, then its packed inputs (draft channel)


@dataclass
class StepHeader:
    op: Op
    num_tokens: int = 0
    num_seqs: int = 0
    width: int = 0  # block-table width
    graph_size: int = 0  # the padded CUDA-graph rows; 0: an eager step
    num_rows: int = 0  # rows sampled (0: no LM head this step)
    rows_are_tokens: bool = False  # row i samples token i (no sample_rows sent)
    num_copies: int = 0  # (src, dst) KV page copies to make before the forward
    num_scored: int = 0  # prompt-scored rows, after the sampled ones (never in a graphed step)
    lora: bool = False  # each sequence's LoRA adapter slot follows (-1: the base model)

    @property
    def table_entries(self) -> int:
        return (self.graph_size or self.num_seqs) * self.width


class StepBuffers(Protocol):
    """The host int buffers a step's forward reads (engine/execution/step_inputs.py's
    StepArrays), each allocated at the largest step: the channel sends their used prefixes."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    block_tables: np.ndarray
    sample_rows: np.ndarray
    group_slots: np.ndarray  # [groups - 1, max_tokens]: KV groups 1..'s (empty with one)
    group_tables: np.ndarray  # [groups - 1, max_seqs * max_pages]


class StepChannel:
    """Rank 0 `send`s, every other rank `receive`s, into the same host StepArrays."""

    def __init__(self, tp: TensorParallel, arrays: StepBuffers, max_copies: int) -> None:
        self.tp = tp
        self.arrays = arrays
        self.header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        seqs = arrays.seq_lens.size
        capacity = sum(a.size for a in _int_arrays(arrays)) + seqs + 2 * max_copies
        capacity += arrays.group_slots.size + arrays.group_tables.size
        self.lora_slots = np.zeros(seqs, dtype=np.int64)  # a worker's: the last STEP's
        self.payload = torch.zeros(capacity, dtype=torch.int64)
        self._payload = self.payload.numpy()
        self.last_send = time.monotonic()  # rank 0: when it last told the workers anything

    def send(
        self,
        header: StepHeader,
        copies: list[tuple[int, int]] | None = None,
        lora_slots: np.ndarray | None = None,
    ) -> None:
        """`lora_slots`: with `header.lora`, each sequence's adapter slot."""
        self.last_send = time.monotonic()
        self.header.numpy()[:] = [
            header.op,
            header.num_tokens,
            header.num_seqs,
            header.width,
            header.graph_size,
            header.num_rows,
            header.rows_are_tokens,
            header.num_copies,
            header.num_scored,
            header.lora,
        ]
        self.tp.broadcast(self.header)
        if header.op not in (Op.STEP, Op.DRAFT):
            return
        parts = self._parts(header)
        if header.lora:
            assert lora_slots is not None and lora_slots.size == header.num_seqs
            parts.append(lora_slots)
        if copies:
            parts.append(np.asarray(copies, dtype=np.int64).reshape(-1))
        total = sum(p.size for p in parts)
        np.concatenate(parts, out=self._payload[:total])
        self.tp.broadcast(self.payload[:total])

    def receive(self) -> tuple[StepHeader, list[tuple[int, int]]]:
        """The next message's header; a STEP's inputs are then in the arrays (its LoRA
        slots in `lora_slots`), and the page copies to make first are returned. A DRAFT's
        inputs are left for the draft channel's `receive_inputs`."""
        self.tp.broadcast(self.header)
        values = self.header.tolist()
        op, tokens, seqs, width, graph_size, rows, rows_are_tokens, copies, scored, lora = values
        header = StepHeader(
            Op(op), tokens, seqs, width, graph_size, rows, bool(rows_are_tokens), copies, scored
        )
        header.lora = bool(lora)
        if header.op is not Op.STEP:
            return header, []
        return header, self.receive_inputs(header)

    def receive_inputs(self, header: StepHeader) -> list[tuple[int, int]]:
        """The inputs `header` announced, into this channel's arrays; the page copies."""
        parts = self._parts(header)
        if header.lora:
            parts.append(self.lora_slots[: header.num_seqs])
        total = sum(p.size for p in parts) + 2 * header.num_copies
        self.tp.broadcast(self.payload[:total])
        offset = 0
        for part in parts:
            part[:] = self._payload[offset : offset + part.size]
            offset += part.size
        flat = self._payload[offset:total].tolist()
        return list(zip(flat[::2], flat[1::2], strict=True))

    def _parts(self, h: StepHeader) -> list[np.ndarray]:
        """Views of the arrays a step reads, in payload order."""
        a = self.arrays
        parts = [
            a.input_ids[: h.num_tokens],
            a.positions[: h.num_tokens],
            a.slot_mapping[: h.num_tokens],
            a.seq_lens[: h.num_seqs],
            a.query_start_loc[: h.num_seqs + 1],
            a.block_tables[: h.table_entries],
        ]
        for slots, tables in zip(a.group_slots, a.group_tables, strict=True):
            parts += [slots[: h.num_tokens], tables[: h.table_entries]]
        if h.num_rows + h.num_scored and not h.rows_are_tokens:
            parts.append(a.sample_rows[: h.num_rows + h.num_scored])
        return parts


def _int_arrays(a: StepBuffers) -> list[np.ndarray]:
    return [
        a.input_ids,
        a.positions,
        a.slot_mapping,
        a.seq_lens,
        a.query_start_loc,
        a.block_tables,
        a.sample_rows,
    ]
