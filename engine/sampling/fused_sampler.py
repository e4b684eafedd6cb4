"""The sampler as a few Triton kernels: the fast path on CUDA, same contract as Sampler.

Each row is split over several programs, each a slice of the row's vocabulary, so that one row
fills the GPU as well as many; the launches of a call (engine/sampling/fused_passes.py, then
engine/sampling/fused_finish.py) are, with the options a batch uses:
1. `stats_pass`: penalty and ban marks, then max, greedy argmax, log-sum-exp partials,
   top-logprob candidates and top-k's first radix histogram, in one pass;
2. top-k: `count_pass` x 3, the other radix digits (engine/sampling/fused_select.py), then
   `gather_pass` copies the survivors of a row with few (engine/sampling/fused_survivors.py);
3. top-p: `mass_pass` x 4, a radix select weighted by the masses, for the other rows;
4. top-k: `survivors_race`, top-p, min-p and the race on a row's gathered survivors;
5. `race_pass`: the exponential race over the kept tokens of the other sampled rows;
6. `finish`: one program per row merges the slices' partials and writes the output.
A pass reads the logits in their own dtype and recomputes the processed logits from them
(nothing [rows, vocab] is written but the penalty marks). Every decision uses
engine/sampling/sampling_math.py's arithmetic with the same operations in the same order
(correctly rounded division, no fused multiply-add; its exp, log and hash as Triton functions
in engine/sampling/fused_math.py) and the slices meet only through integer atomics, so the
kernels pick exactly the tokens the torch Sampler picks; logprobs agree to float32 rounding.

A batch with a sampling surface (engine/sampling/surface.py) has it applied to its logits, in
float32, before the first launch: the torch Sampler applies the same function to the same
float32 numbers. Raw logprobs would then come from the changed logits, so such a batch must
not ask for them (sampler_choice.FusedOrTorch runs the torch Sampler instead).

The kernels also run under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, which is
how the tests check them against the torch Sampler.
"""

from __future__ import annotations

import torch
import triton

from engine.sampling.fused_finish import finish
from engine.sampling.fused_passes import count_pass, mass_pass, race_pass, stats_pass
from engine.sampling.fused_select import LEVELS, SCRATCH
from engine.sampling.fused_survivors import gather_pass, survivors_race
from engine.sampling.sampler import SamplerOutput, SamplingBatch
from engine.sampling.surface import apply_surface

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedSampler:
    """Sampler's contract in 2 to 12 kernel launches (by the options the batch uses).

    `block` tokens per iteration; `num_programs` the programs a call aims at (rows times
    splits), by default twice the GPU's SMs (4 under the interpreter); `survivors` the most
    top-k survivors a row may have to be finished on them alone (a power of 2). The scratch for penalty
    and ban marks ([rows, vocab] int32) and for the radix histograms and winners ([rows,
    SCRATCH] int64), zero between calls, is allocated on the first step that needs it and grows
    with the batch.
    """

    def __init__(
        self,
        block: int = 1024,
        num_programs: int | None = None,
        num_warps: int = 8,
        survivors: int = 1024,
    ) -> None:
        self.block = block
        self.survivors = survivors
        self.num_programs = num_programs
        self.num_warps = num_warps
        self._marks: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None

    def splits(self, rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
        """(programs per row, tokens per program): a function of the batch size and vocabulary
        only, so that every step of a batch size (CUDA graph or eager) splits alike."""
        if self.num_programs is None:
            self.num_programs = 4
            if device.type == "cuda":
                self.num_programs = (
                    2 * torch.cuda.get_device_properties(device).multi_processor_count
                )
        wanted = max(1, self.num_programs // rows)
        slice_len = triton.cdiv(triton.cdiv(vocab, wanted), self.block) * self.block
        return triton.cdiv(vocab, slice_len), slice_len

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        rows, vocab = logits.shape
        assert logits.dtype in LOGIT_DTYPES, logits.dtype
        if batch.has_surface:
            assert not batch.raw_logprobs, "raw logprobs with a sampling surface: torch Sampler"
            logits = apply_surface(logits.float(), *batch.surface())
        assert logits.stride(1) == 1 and batch.floats.is_contiguous()
        assert batch.ints.is_contiguous()
        device = logits.device
        splits, slice_len = self.splits(rows, vocab, device)
        sample = not batch.all_greedy
        top_k, top_p = batch.use_top_k and sample, batch.use_top_p and sample
        penalties, bans = batch.use_penalties, batch.suppress_ids is not None
        marks = self._marks_for(rows, vocab, device) if penalties or bans else batch.ints
        scratch = self._scratch_for(rows, device)
        ctx = batch.context_ids if batch.context_ids is not None else batch.ints
        ban = batch.suppress_ids if batch.suppress_ids is not None else batch.ints
        raw_rows = batch.raw_rows if batch.raw_rows is not None else batch.ints
        raw, k = batch.raw_logprobs, batch.num_top_logprobs
        wants_logprobs = batch.logprobs or raw
        top_slots = triton.next_power_of_2(max(k, 1))
        parts, tops, out = _outputs(rows, splits, k, top_slots, wants_logprobs, device)

        grid = (rows, splits)
        row_args = (logits, logits.stride(0), batch.floats, batch.ints)
        flags = {"PENALTIES": penalties, "BANS": bans, "BLOCK": self.block}
        self.launch(
            stats_pass, grid, *row_args, ctx, ctx.stride(0), ctx.shape[1],
            ban, ban.stride(0), ban.shape[1], marks, raw_rows, scratch, parts, tops,
            vocab, slice_len, **flags, TOP_K=top_k, LOGPROBS=batch.logprobs, RAW=raw,
            NUM_TOP=k, TOPB=top_slots,
        )  # fmt: skip
        pass_args = (*row_args, marks, scratch, vocab, slice_len)
        room = {"SURVIVORS": self.survivors}
        if top_k or top_p:
            self._filter(grid, batch, row_args, pass_args, flags, top_k, top_p)
        if sample:
            self.launch(
                race_pass, grid, *pass_args, **flags, TOP_K=top_k, TOP_P=top_p,
                MIN_P=batch.use_min_p, **room,
            )  # fmt: skip
        self.launch(
            finish, (rows,), logits, logits.stride(0), batch.floats, ctx, ctx.stride(0),
            ctx.shape[1], ban, ban.stride(0), ban.shape[1], marks, raw_rows, scratch, parts,
            tops, out, vocab, splits, **flags, SAMPLE=sample, TOP_K=top_k, TOP_P=top_p,
            LOGPROBS=batch.logprobs, RAW=raw, NUM_TOP=k, TOPB=top_slots, CHUNK=128,
        )  # fmt: skip
        return SamplerOutput(out, k if wants_logprobs else 0)

    def _filter(
        self,
        grid: tuple[int, int],
        batch: SamplingBatch,
        row_args: tuple,
        pass_args: tuple,
        flags: dict,
        top_k: bool,
        top_p: bool,
    ) -> None:
        """The top-k and top-p passes: the levels of the radix search, then the survivors' race."""
        rows, device = grid[0], batch.floats.device
        marks, scratch, vocab, slice_len = pass_args[len(row_args) :]
        room = {"SURVIVORS": self.survivors}
        cands = torch.empty(rows * self.survivors if top_k else 1, dtype=torch.int64, device=device)
        if top_k:
            for level in range(1, LEVELS):
                self.launch(count_pass, grid, *pass_args, **flags, LEVEL=level)
            self.launch(
                gather_pass, grid, *row_args, marks, scratch, cands, vocab, slice_len, **flags,
                **room,
            )  # fmt: skip
        if top_p:
            for level in range(LEVELS):
                self.launch(mass_pass, grid, *pass_args, **flags, TOP_K=top_k, LEVEL=level, **room)
        if top_k:
            self.launch(
                survivors_race, (rows,), batch.floats, batch.ints, scratch, cands, vocab,
                TOP_P=top_p, MIN_P=batch.use_min_p, **room,
            )  # fmt: skip

    def launch(self, kernel: triton.JITFunction, grid: tuple[int, ...], *args, **kwargs) -> None:
        """One kernel launch of a call (a method of its own so that tools can count them)."""
        kernel[grid](
            *args, **kwargs, num_warps=self.num_warps,
            # NOTE: a contracted a * b + c rounds once, torch's twice: the tokens could differ.
            enable_fp_fusion=False,
        )  # fmt: skip

    def _marks_for(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        marks = self._marks
        if marks is None or marks.shape[0] < rows or marks.shape[1] != vocab:
            marks = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
            self._marks = marks
        return marks

    def _scratch_for(self, rows: int, device: torch.device) -> torch.Tensor:
        scratch = self._scratch
        if scratch is None or scratch.shape[0] < rows:
            scratch = torch.zeros(rows, SCRATCH, dtype=torch.int64, device=device)
            self._scratch = scratch
        return scratch


def _outputs(
    rows: int, splits: int, k: int, top_slots: int, wants_logprobs: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The passes' partial sums and top candidates, and the call's output rows."""
    parts = torch.empty(rows * splits * 4 if wants_logprobs else 1, device=device)
    tops = torch.empty(rows * splits * top_slots if k else 1, dtype=torch.int64, device=device)
    if wants_logprobs:
        return parts, tops, torch.empty(rows, 2 + 2 * k, dtype=torch.float64, device=device)
    return parts, tops, torch.empty(rows, dtype=torch.int64, device=device)
