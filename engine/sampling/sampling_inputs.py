"""SamplingInputs: a step's SamplingBatch, built from the rows SamplingSlots keeps.

The per-row numbers are gathered into the step's buffers and the batch's flags are the OR of
the rows' bits (engine/sampling/sampling_slots.py); what varies with the tokens (the token
histories penalties read, the stop ids banned below min_tokens, the sampling surface's
masks: engine/sampling/surface_rows.py) becomes a tensor of its own,
only when some row needs it; structured-output rows get a GrammarMask, filled while the step
runs (engine/structured/grammar_mask.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from engine.kv_cache.block_table import BlockTable
from engine.protocol.messages import SUPPORT_TIES, LogprobMode
from engine.sampling import sampling_slots as slot_bits
from engine.sampling.sampler import SamplingBatch
from engine.sampling.sampling_slots import SamplingSlots
from engine.sampling.surface_rows import surface_tensors
from engine.scheduling.request import Request
from engine.structured.grammar_mask import GrammarMask


class HostRows(Protocol):
    """The host's numpy views of a step's sampling rows (engine/execution/step_inputs.py's
    StepArrays): [max_rows, 6] float32 and [max_rows, 5] int64."""

    sampling_floats: np.ndarray
    sampling_ints: np.ndarray


class StepRows(Protocol):
    """A step's sampling-row tensors, on the host or the device (StepInputs)."""

    sampling_floats: torch.Tensor
    sampling_ints: torch.Tensor


class SamplingInputs:
    def __init__(
        self, device: torch.device, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.slots = SamplingSlots()
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def batch(
        self,
        reqs: list[Request],
        table: BlockTable,
        host: StepRows,
        arrays: HostRows,
        inputs: StepRows,
    ) -> SamplingBatch:
        """Per-row sampling inputs: each row's numbers gathered from SamplingSlots (written
        once per request) into the step buffers (`host`, its numpy `arrays`; then `inputs`,
        the device's: two copies); token lists (penalties, min_tokens) as tensors of their
        own, only when some row needs them."""
        rows = len(reqs)
        flags, top, banned = self.slots.gather(
            table, reqs, arrays.sampling_floats, arrays.sampling_ints
        )
        f, i = inputs.sampling_floats[:rows], inputs.sampling_ints[:rows]
        if inputs is not host:
            f.copy_(host.sampling_floats[:rows], non_blocking=True)
            i.copy_(host.sampling_ints[:rows], non_blocking=True)
        batch = SamplingBatch(
            floats=f,
            ints=i,
            all_greedy=not flags & slot_bits.SAMPLED,
            use_top_k=bool(flags & slot_bits.TOP_K),
            use_top_p=bool(flags & slot_bits.TOP_P),
            use_min_p=bool(flags & slot_bits.MIN_P),
            use_penalties=bool(flags & slot_bits.PENALTIES),
            num_top_logprobs=top,
            logprobs=bool(flags & slot_bits.LOGPROBS),
            raw_logprobs=bool(flags & slot_bits.RAW_LOGPROBS),
            sampled_logprobs=bool(flags & slot_bits.SAMPLED_LOGPROBS),
        )
        if batch.num_top_logprobs:  # top logprobs without logprobs rank by the row's mode
            batch.logprobs = batch.logprobs or bool(flags & slot_bits.PROCESSED)
            batch.raw_logprobs = batch.raw_logprobs or bool(flags & slot_bits.RAW)
            batch.sampled_logprobs = batch.sampled_logprobs or bool(flags & slot_bits.SAMPLED_MODE)
        kinds = (batch.logprobs, batch.raw_logprobs, batch.sampled_logprobs)
        if sum(kinds) > 1:  # each row's own
            modes = [r.params.mode for r in reqs]
            batch.raw_rows = self._rows_in(modes, LogprobMode.RAW) if kinds[1] else None
            batch.sampled_rows = self._rows_in(modes, LogprobMode.SAMPLED) if kinds[2] else None
        if flags & slot_bits.SUPPORT:
            bound = max(r.params.support_bound for r in reqs if r.params.sampling_support)
            batch.support_width = min(self.vocab_size, bound + SUPPORT_TIES)
        self._token_lists(batch, reqs, banned)
        if flags & slot_bits.SURFACE:
            surfaces = self.slots.row_surfaces(reqs)
            tensors = surface_tensors(reqs, surfaces, self.vocab_size, self.device)
            batch.allowed_ids, batch.allowed_rows, batch.bias_ids, batch.bias_values = tensors
        if flags & slot_bits.GRAMMAR:
            grammars = [(row, r.grammar) for row, r in enumerate(reqs) if r.grammar is not None]
            batch.grammar = GrammarMask(grammars, rows, self.vocab_size, self.device)
        return batch

    def _token_lists(self, batch: SamplingBatch, reqs: list[Request], banned: np.ndarray) -> None:
        """The rows' token lists as padded tensors, when some row needs them: penalised rows'
        histories, and the stop ids of `banned` rows (still below their min_tokens)."""
        if batch.use_penalties:
            # Only penalised rows need their history (empty ones change no logit).
            histories = [r.token_ids if slot_bits.uses_penalties(r) else [] for r in reqs]
            batch.context_ids = self._padded(histories)
        if len(banned):
            stop_ids: list[tuple[int, ...]] = [()] * len(reqs)
            for row in banned.tolist():
                stop_ids[row] = self._stop_ids(reqs[row])
            if any(stop_ids):
                batch.suppress_ids = self._padded([list(b) for b in stop_ids])

    def _rows_in(self, modes: list[LogprobMode], mode: LogprobMode) -> torch.Tensor:
        return torch.tensor([m is mode for m in modes], device=self.device)

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        eos = () if req.params.ignore_eos else self.eos_token_ids
        return eos + req.params.stop_token_ids

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        """[rows, width] int64 on the device, padded with vocab_size (no token)."""
        width = max(1, max(len(r) for r in rows))
        padded = [r + [self.vocab_size] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int64, device=self.device)
