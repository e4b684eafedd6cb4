"""Turns a scheduled batch into one packed forward pass and samples the next tokens.

Every request in the batch feeds `query_len` tokens starting at its `num_computed_tokens`;
those that reach the end of their tokens get their last position's logits sampled. Only
those rows go through the LM head.

The hot path: step inputs are written into preallocated host buffers (pinned on CUDA) through
numpy views and copied to the device without blocking; nothing inside the step waits for the
device; one device-to-host copy brings back the sampled ids (and logprobs when any row asked
for them). Decode steps replay CUDA graphs when a graph runner is attached.

Tensor parallel: rank 0's runner `run`s batches and sends each step's filled host buffers
through its StepChannel before the forward; every other rank's runner `follow`s them, running
the same forward (and LM head) on its shard, and samples nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.execution.cuda_graph import CUDAGraphRunner
from engine.execution.step_inputs import StepInputs
from engine.models.llama import LlamaForCausalLM
from engine.parallel.step_channel import Op, StepChannel, StepHeader
from engine.sampling.sampler import SamplerOutput, SamplingBatch
from engine.sampling.sampler_choice import make_sampler
from engine.scheduling.page_pool import PagePool
from engine.scheduling.request import Request
from engine.scheduling.scheduler import ScheduledBatch


@dataclass
class Sampled:
    """The tokens sampled this step, one per sampling request, on the host."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


@dataclass
class PreparedStep:
    """A step's shape, once its inputs are in the host buffers."""

    num_tokens: int
    num_seqs: int
    width: int  # block-table width
    sampling: list[Request]  # one per sampled row (siblings share their leader's row)
    rows_are_tokens: bool  # row i samples token i: no gather before the LM head
    num_rows: int  # sampled rows (a worker rank knows only their number)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: PagePool,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        sampler: Callable[[torch.Tensor, SamplingBatch], SamplerOutput] | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.config.vocab_size
        self.kv_caches = pool.layer_caches()
        self.sampler = sampler or make_sampler("torch", device)
        self.page_size = pool.page_size
        self.max_pages = pool.pages_for(model.config.max_model_len)
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        sizes = (max_tokens, max_num_seqs, self.max_pages, max_num_seqs)
        self.host = StepInputs.allocate(*sizes, torch.device("cpu"), pin=device.type == "cuda")
        self.arrays = self.host.numpy()
        self._floats_flat = self.arrays.sampling_floats.reshape(-1)  # views, same memory
        self._ints_flat = self.arrays.sampling_ints.reshape(-1)
        # On the CPU the host buffers are the step's tensors: nothing to copy.
        self.inputs = self.host if device.type == "cpu" else StepInputs.allocate(*sizes, device)
        self.graphs: CUDAGraphRunner | None = None
        # Recorded after a step's uploads: the next step refills the host buffers only once
        # the device has read them (a step that samples nothing ends without a sync).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.channel: StepChannel | None = None  # rank 0 of a tensor-parallel group

    def open_channel(self) -> StepChannel:
        """Tensor parallel: the channel rank 0 sends each step's inputs through, and other
        ranks receive them from (into this runner's host buffers)."""
        max_copies = self.host.seq_lens.shape[0]  # one per forked sibling, at most
        self.channel = StepChannel(self.model.tp, self.arrays, max_copies)
        if self.model.tp.rank == 0:
            self.pool.copy_log = []  # sent with the next step: workers copy the same pages
        return self.channel

    def attach_graphs(self, capture: bool, compile: bool = False) -> None:
        """Run decode steps through a CUDAGraphRunner (captured now when `capture`)."""
        self.graphs = CUDAGraphRunner(
            self.model,
            self.kv_caches,
            self.pool,
            self.host.seq_lens.shape[0],
            self.max_pages,
            capture,
            compile,
        )
        self.graphs.capture()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> Sampled:
        num_seqs = len(batch.requests)
        width = max(len(r.pages) for r in batch.requests)
        graphs = self.graphs
        decode = batch.num_tokens == num_seqs
        size = graphs.bucket(num_seqs) if graphs is not None and decode else None
        if graphs is not None and size is not None:  # a decode step with a graph to replay
            step = self._prepare(batch, width, graph_rows=size)
            self._send(step, graph_size=size)
            logits = graphs.run(self.host, self.arrays, num_seqs, width)  # every row's
            self._record_upload()
            if not step.sampling:
                return Sampled([], [], None, None, None)
            if not step.rows_are_tokens:
                logits = logits[self._sample_rows(step)]
        else:
            step = self._prepare(batch, width)
            self._send(step, graph_size=0)
            hidden = self._forward(step)
            if not step.sampling:
                return Sampled([], [], None, None, None)
            if not step.rows_are_tokens:
                hidden = hidden[self._sample_rows(step)]
            logits = self.model.compute_logits(hidden)
        out = self.sampler(logits, self._sampling_batch(step.sampling))
        return self._to_host(step.sampling, out)

    def _send(self, step: PreparedStep, graph_size: int) -> None:
        if self.channel is None:
            return
        header = StepHeader(
            Op.STEP,
            step.num_tokens,
            step.num_seqs,
            step.width,
            graph_size,
            0 if graph_size else step.num_rows,  # a graphed step gathers every row's logits
            step.rows_are_tokens,
        )
        copies = self.pool.copy_log or []
        header.num_copies = len(copies)
        self.channel.send(header, copies)
        copies.clear()

    @torch.inference_mode()
    def follow(self, header: StepHeader, copies: list[tuple[int, int]]) -> None:
        """A worker rank: run the step rank 0 described (its inputs are in the host buffers),
        joining every collective rank 0's `run` makes."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        for src, dst in copies:
            self.pool.copy_page(src, dst)
        if header.graph_size:
            assert self.graphs is not None
            self.graphs.run(self.host, self.arrays, header.num_seqs, header.width)
            self._record_upload()
            return
        step = PreparedStep(
            header.num_tokens,
            header.num_seqs,
            header.width,
            [],
            header.rows_are_tokens,
            header.num_rows,
        )
        hidden = self._forward(step)
        if step.num_rows:
            if not step.rows_are_tokens:
                hidden = hidden[self._sample_rows(step)]
            self.model.compute_logits(hidden)

    def _record_upload(self) -> None:
        if self._uploaded is not None:
            self._uploaded.record()

    def _sample_rows(self, step: PreparedStep) -> torch.Tensor:
        rows = step.num_rows
        if self.inputs is not self.host:
            self.inputs.sample_rows[:rows].copy_(self.host.sample_rows[:rows], non_blocking=True)
        return self.inputs.sample_rows[:rows]

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        """The eager forward of any step: [tokens, hidden]."""
        num_tokens, num_seqs, width = step.num_tokens, step.num_seqs, step.width
        if self.inputs is not self.host:
            self.inputs.copy_from(self.host, num_tokens, num_seqs, num_seqs * width)
            self._record_upload()
        inp = self.inputs
        # From the host buffers, not the requests: a worker rank has only the buffers.
        starts = self.arrays.query_start_loc[: num_seqs + 1]
        query_lens = (starts[1:] - starts[:-1]).tolist()
        context_lens = self.arrays.seq_lens[:num_seqs].tolist()
        meta = AttentionMetadata(
            query_lens=query_lens,
            context_lens=context_lens,
            slot_mapping=inp.slot_mapping[:num_tokens],
            block_tables=inp.block_table(num_seqs, width),
            seq_lens=inp.seq_lens[:num_seqs],
            query_start_loc=inp.query_start_loc[: num_seqs + 1],
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            decode_only=num_tokens == num_seqs,
        )
        return self.model(
            inp.input_ids[:num_tokens], inp.positions[:num_tokens], meta, self.kv_caches
        )

    def _prepare(
        self, batch: ScheduledBatch, width: int, graph_rows: int | None = None
    ) -> PreparedStep:
        """Write the step's inputs into the host buffers (no tensors are created here).
        A graphed step's block table is page-major for its `graph_rows` (padded) rows."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's uploads have been read
        reqs = batch.requests
        if batch.num_tokens == len(reqs):
            self._fill_decode(reqs)
        else:
            self._fill_packed(reqs, batch.query_lens)
        if graph_rows is None:
            tables = self.arrays.block_table(len(reqs), width)
        else:
            tables = self.arrays.block_table(graph_rows, width, page_major=True)
        for i, r in enumerate(reqs):
            tables[i, : len(r.pages)] = r.pages
        return self._sampled_rows(batch, width)

    def _fill_decode(self, reqs: list[Request]) -> None:
        """One token per sequence: a few list comprehensions, no per-token loop."""
        a, size, num_seqs = self.arrays, self.page_size, len(reqs)
        starts = [r.num_computed_tokens for r in reqs]
        a.input_ids[:num_seqs] = [r.token_ids[s] for r, s in zip(reqs, starts, strict=True)]
        a.positions[:num_seqs] = starts
        a.slot_mapping[:num_seqs] = [
            r.pages[s // size] * size + s % size for r, s in zip(reqs, starts, strict=True)
        ]
        a.seq_lens[:num_seqs] = starts
        a.seq_lens[:num_seqs] += 1
        a.query_start_loc[: num_seqs + 1] = np.arange(num_seqs + 1)

    def _fill_packed(self, reqs: list[Request], query_lens: list[int]) -> None:
        """Any mix of prefill chunks and decodes: numpy ranges per sequence."""
        a, size = self.arrays, self.page_size
        t = 0
        for i, (r, n) in enumerate(zip(reqs, query_lens, strict=True)):
            s = r.num_computed_tokens
            positions = np.arange(s, s + n)
            a.input_ids[t : t + n] = r.token_ids[s : s + n]
            a.positions[t : t + n] = positions
            a.slot_mapping[t : t + n] = (
                np.asarray(r.pages)[positions // size] * size + positions % size
            )
            a.seq_lens[i] = s + n
            t += n
        a.query_start_loc[0] = 0
        np.cumsum(query_lens, out=a.query_start_loc[1 : len(reqs) + 1])

    def _sampled_rows(self, batch: ScheduledBatch, width: int) -> PreparedStep:
        """Which requests sample, from which token row (written to `sample_rows` unless row i
        is token i, the steady decode case)."""
        rows: list[int] = []
        sampling: list[Request] = []
        num_seqs, num_tokens = len(batch.requests), batch.num_tokens
        ends = self.arrays.query_start_loc[1 : num_seqs + 1].tolist()
        for r, n, end in zip(batch.requests, batch.query_lens, ends, strict=True):
            if r.num_computed_tokens + n == r.num_tokens:
                # Siblings (n > 1) sample their first tokens from the leader's last prompt row.
                for seq in [r, *r.pending_forks] if r.pending_forks else [r]:
                    rows.append(end - 1)
                    sampling.append(seq)
        rows_are_tokens = len(rows) == num_tokens and rows == list(range(num_tokens))
        if not rows_are_tokens:
            self.arrays.sample_rows[: len(rows)] = rows
        return PreparedStep(num_tokens, num_seqs, width, sampling, rows_are_tokens, len(sampling))

    def _to_host(self, sampling: list[Request], out: SamplerOutput) -> Sampled:
        # NOTE: the step's only device-to-host copy: everything sampled is in one tensor.
        if out.values.dim() == 1:
            return Sampled(sampling, out.values.tolist(), None, None, None)
        packed = out.values.tolist()
        token_ids = [int(row[0]) for row in packed]
        logprobs = [row[1] for row in packed]
        top_ids = top_lps = None
        if k := out.num_top_logprobs:
            top_ids = [[int(t) for t in row[2 : 2 + k]] for row in packed]
            top_lps = [row[2 + k :] for row in packed]
        return Sampled(sampling, token_ids, logprobs, top_ids, top_lps)

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        """Per-row sampling inputs: the per-row numbers through the step buffers (one pass
        over the rows, two copies); token lists (penalties, min_tokens) as tensors of their
        own, only when some row needs them."""
        floats: list[float] = []
        ints: list[int] = []
        banned: list[tuple[int, ...]] = []  # per row, while min_tokens is not reached yet
        for r in reqs:
            p = r.params
            num_output = len(r.token_ids) - r.prompt_len
            # Greedy rows go to the sampler as temperature 0: `greedy` is the only rule.
            temperature = 0.0 if p.greedy else p.temperature
            floats += (temperature, p.top_p, p.min_p)
            floats += (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
            ints += (r.seed & 0xFFFFFFFF, r.seed >> 32, num_output, p.top_k, r.prompt_len)
            banned.append(self._stop_ids(r) if num_output < p.min_tokens else ())
        rows = len(reqs)
        # Flat lists fill numpy several times faster than lists of tuples.
        self._floats_flat[: 6 * rows] = floats
        self._ints_flat[: 5 * rows] = ints
        f, i = self.inputs.sampling_floats[:rows], self.inputs.sampling_ints[:rows]
        if self.inputs is not self.host:
            f.copy_(self.host.sampling_floats[:rows], non_blocking=True)
            i.copy_(self.host.sampling_ints[:rows], non_blocking=True)

        params = [r.params for r in reqs]
        distinct = list({id(p): p for p in params}.values())  # often one shared object
        sampled = [p for p in distinct if not p.greedy]
        batch = SamplingBatch(
            floats=f,
            ints=i,
            all_greedy=not sampled,
            use_top_k=any(p.top_k > 0 for p in sampled),
            use_top_p=any(p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
            use_penalties=any(
                p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
                for p in distinct
            ),
            num_top_logprobs=max(p.top_logprobs for p in distinct),
            logprobs=any(p.logprobs and not p.raw_logprobs for p in distinct),
            raw_logprobs=any(p.logprobs and p.raw_logprobs for p in distinct),
        )
        if batch.num_top_logprobs:
            batch.logprobs = batch.logprobs or any(not p.raw_logprobs for p in distinct)
            batch.raw_logprobs = batch.raw_logprobs or any(p.raw_logprobs for p in distinct)
        if batch.logprobs and batch.raw_logprobs:
            batch.raw_rows = torch.tensor([p.raw_logprobs for p in params], device=self.device)
        if batch.use_penalties:
            batch.context_ids = self._padded([r.token_ids for r in reqs])
        if any(banned):
            batch.suppress_ids = self._padded([list(b) for b in banned])
        return batch

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        eos = () if req.params.ignore_eos else self.eos_token_ids
        return eos + req.params.stop_token_ids

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        """[rows, width] int64 on the device, padded with vocab_size (no token)."""
        width = max(1, max(len(r) for r in rows))
        padded = [r + [self.vocab_size] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int64, device=self.device)
