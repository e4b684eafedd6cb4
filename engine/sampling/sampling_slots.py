"""SamplingSlots: each running request's sampling parameters, written once, gathered per step.

A request's sampling numbers (temperature, top-p, min-p, penalties, seed, top-k, where its
output starts) and what it asks of the sampler (top-k on, logprobs, ...) do not change while
it runs. They are written into the row of its BlockTable slot when the slot changes hands
(its epoch moves: a new request, or the same one re-admitted after preemption) and a step
gathers its rows with one numpy index; only the noise counter (the output index) is
per-step. Its sampling surface (logit bias, allowed and banned ids) is kept as a RowSurface
(engine/sampling/surface_rows.py) beside the row. A row without a slot (a sibling of n > 1
sampling its first token from its leader's prompt, before it forks) is filled on its own,
every time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.kv_cache.block_table import BlockTable
from engine.protocol.messages import LogprobMode
from engine.sampling.surface_rows import RowSurface, has_long_bad_words, row_surface
from engine.scheduling.request import Request

# Bits of a row's `flags`: what the row asks of the sampler.
SAMPLED = 1  # not greedy
TOP_K = 2  # and top-k on
TOP_P = 4  # and top-p below 1
MIN_P = 8  # and min-p above 0
PENALTIES = 16  # any penalty (greedy or not)
LOGPROBS = 32  # processed logprobs
RAW_LOGPROBS = 64  # raw logprobs
SAMPLED_LOGPROBS = 128  # logprobs of the truncated distribution
RAW = 256  # its logprob mode (what its top logprobs rank by): RAW,
PROCESSED = 512  # PROCESSED,
SAMPLED_MODE = 1024  # or SAMPLED
SUPPORT = 2048  # the sampling support
SURFACE = 4096  # a sampling surface
GRAMMAR = 8192  # a structured-output constraint
MODE_BITS = {
    LogprobMode.RAW: (RAW_LOGPROBS, RAW),
    LogprobMode.PROCESSED: (LOGPROBS, PROCESSED),
    LogprobMode.SAMPLED: (SAMPLED_LOGPROBS, SAMPLED_MODE),
}


class SamplingSlots:
    def __init__(self) -> None:
        self.floats = np.zeros((0, 6), dtype=np.float32)  # SamplingBatch.floats' columns
        self.ints = np.zeros((0, 5), dtype=np.int64)  # its ints' (the counter left 0)
        self.flags = np.zeros(0, dtype=np.int64)
        self.top_logprobs = np.zeros(0, dtype=np.int64)
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.epochs = np.zeros(0, dtype=np.int64)  # the slot epoch each row was filled for
        self._surfaces: list[RowSurface | None] = []

    def gather(
        self, table: BlockTable, reqs: Sequence[Request], floats: np.ndarray, ints: np.ndarray
    ) -> tuple[int, int, np.ndarray]:
        """Write the rows of `reqs` into `floats` and `ints` (the step's host buffers, at least
        len(reqs) rows). Returns (the OR of their flags, their largest top_logprobs, the rows
        whose min_tokens is not reached yet). With SURFACE in the flags, `row_surfaces(reqs)`
        gives their sampling surfaces."""
        if len(self.epochs) != table.num_slots:
            self._resize(table.num_slots)
        rows = len(reqs)
        slots = [r.slot for r in reqs]
        slotless = [i for i, s in enumerate(slots) if s is None] if None in slots else []
        index = np.array([0 if s is None else s for s in slots] if slotless else slots, np.int64)
        stale = np.flatnonzero(self.epochs[index] != table.epochs[index])
        for i in stale.tolist():
            slot = slots[i]
            if slot is not None:
                self._fill(slot, reqs[i], int(table.epochs[slot]))
        floats[:rows] = self.floats[index]
        ints[:rows] = self.ints[index]
        flags = self.flags[index]
        top = self.top_logprobs[index]
        min_tokens = self.min_tokens[index]
        for i in slotless:  # rare: the step that ends an n > 1 prompt
            row_floats, row_ints, flags[i], top[i], min_tokens[i] = _row(reqs[i])
            floats[i], ints[i] = row_floats, row_ints
        num_output = np.array([len(r.token_ids) + r.num_pending for r in reqs], dtype=np.int64)
        num_output -= ints[:rows, 4]  # the prompt length
        ints[:rows, 2] = num_output
        banned = np.flatnonzero(num_output < min_tokens)
        top_max = int(top.max()) if rows else 0
        return int(np.bitwise_or.reduce(flags)) if rows else 0, top_max, banned

    def row_surfaces(self, reqs: Sequence[Request]) -> list[RowSurface | None]:
        """The sampling surfaces of rows just gathered (a slotless row's made on the spot)."""
        return [row_surface(r.params) if r.slot is None else self._surfaces[r.slot] for r in reqs]

    def _fill(self, slot: int, req: Request, epoch: int) -> None:
        row_floats, row_ints, flags, top, min_tokens = _row(req)
        self.floats[slot], self.ints[slot] = row_floats, row_ints
        self.flags[slot], self.top_logprobs[slot], self.min_tokens[slot] = flags, top, min_tokens
        self._surfaces[slot] = row_surface(req.params)
        self.epochs[slot] = epoch

    def _resize(self, num_slots: int) -> None:
        """Follow the table's slot count; every row is refilled (epoch -1 matches none)."""
        self.floats = np.zeros((num_slots, 6), dtype=np.float32)
        self.ints = np.zeros((num_slots, 5), dtype=np.int64)
        self.flags = np.zeros(num_slots, dtype=np.int64)
        self.top_logprobs = np.zeros(num_slots, dtype=np.int64)
        self.min_tokens = np.zeros(num_slots, dtype=np.int64)
        self.epochs = np.full(num_slots, -1, dtype=np.int64)
        self._surfaces = [None] * num_slots


def _row(req: Request) -> tuple[tuple[float, ...], tuple[int, ...], int, int, int]:
    """(floats, ints, flags, top_logprobs, min_tokens) of one request's sampling row."""
    p = req.params
    # Greedy rows go to the sampler as temperature 0: `greedy` is the only rule.
    temperature = 0.0 if p.greedy else p.temperature
    floats: tuple[float, ...] = (temperature, p.top_p, p.min_p)
    floats += (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
    ints = (req.seed & 0xFFFFFFFF, req.seed >> 32, 0, p.top_k, req.prompt_len)
    flags = 0
    if not p.greedy:
        flags |= SAMPLED
        flags |= TOP_K if p.top_k > 0 else 0
        flags |= TOP_P if p.top_p < 1.0 else 0
        flags |= MIN_P if p.min_p > 0.0 else 0
    if uses_penalties(req):
        flags |= PENALTIES
    logprobs, mode = MODE_BITS[p.mode]
    flags |= mode | (logprobs if p.logprobs else 0) | (SUPPORT if p.sampling_support else 0)
    flags |= SURFACE if p.has_surface else 0
    flags |= GRAMMAR if p.structured is not None else 0
    return floats, ints, flags, p.top_logprobs, p.min_tokens


def reads_history(req: Request) -> bool:
    """The sampler reads the request's tokens on the host: penalties, bad words of two or
    more ids, or a grammar (an overlapped step's pending token is not there yet)."""
    return uses_penalties(req) or has_long_bad_words(req) or req.params.structured is not None


def uses_penalties(req: Request) -> bool:
    """Any penalty on (greedy or not): the sampler reads the request's token history."""
    p = req.params
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty)
