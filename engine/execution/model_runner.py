"""Turns a scheduled batch into one packed forward pass and samples the next tokens.

Every request in the batch feeds `query_len` tokens starting at its `num_computed_tokens`;
those that reach the end of their tokens get their last position's logits sampled (a
speculative draft's tokens are rows of their own: engine/execution/draft_rows.py). Only
those rows go through the LM head, and the prompt positions a request asked to score
(prompt logprobs: engine/execution/prompt_scoring.py).

The hot path: step inputs are written into preallocated host buffers (pinned on CUDA) through
numpy views and copied to the device without blocking; nothing inside the step waits for the
device; one device-to-host copy brings back the sampled ids (and logprobs when any row asked
for them). Decode steps replay CUDA graphs when a graph runner is attached. `run` is
`collect(launch(..))`: the engine's overlapped loop launches a step before it collects the
previous one (engine/execution/launched_step.py).

Tensor parallel: rank 0's runner `run`s batches and sends each step's filled host buffers
through its StepChannel before the forward; every other rank's runner `follow`s them, running
the same forward (and LM head) on its shard, and samples nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.execution.cuda_graph import CUDAGraphRunner
from engine.execution.draft_rows import as_decode_rows
from engine.execution.kv_group_inputs import fill_groups, group_caches
from engine.execution.launched_step import (
    DeviceThread,
    LaunchedStep,
    PendingInputs,
    Sampled,
    StepResult,
    eager_hidden,
    graph_outputs,
    run_now,
    sampled_on_host,
    to_host_async,
)
from engine.execution.prompt_scoring import ScoredRows, follow_scored_rows, score_rows
from engine.execution.step_inputs import (
    StepArrays,
    StepInputs,
    fill_decode,
    fill_packed,
    forward_inputs,
)
from engine.execution.step_rows import PreparedStep, lm_head_rows
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.page_pool import PagePool
from engine.lora.adapter_file import AdapterFile
from engine.lora.adapter_slots import share_slot
from engine.lora.lora_weights import LoraStep
from engine.lora.registry import AdapterRegistry
from engine.models.base import CausalLM
from engine.moe.routed_experts import host_rows, routing_record, row_routing
from engine.parallel.step_channel import Op, StepChannel, StepHeader
from engine.sampling.sampler import SamplerOutput, SamplingBatch
from engine.sampling.sampler_choice import make_sampler
from engine.sampling.sampling_inputs import SamplingInputs
from engine.scheduling.request import Request
from engine.scheduling.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
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
        self.kv_caches = group_caches(pool)
        self.sampler = sampler or make_sampler("torch", device)
        self.page_size = pool.page_size
        self.max_pages = pool.pages_for(model.config.max_model_len)
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        sizes = (max_tokens, max_num_seqs, self.max_pages, max_num_seqs)
        self.groups = pool.groups.num_groups
        pin = device.type == "cuda"
        self.host = StepInputs.allocate(*sizes, torch.device("cpu"), pin, self.groups)
        self.arrays = self.host.numpy()
        self.sampling_inputs = SamplingInputs(device, self.vocab_size, eos_token_ids)
        self.sampling_slots = self.sampling_inputs.slots
        # On the CPU the host buffers are the step's tensors: nothing to copy.
        on_cpu, groups = device.type == "cpu", self.groups
        self.inputs = self.host if on_cpu else StepInputs.allocate(*sizes, device, False, groups)
        self.graphs: CUDAGraphRunner | None = None
        # Recorded after a step's uploads: the next step refills the host buffers only once
        # the device has read them (a step that samples nothing ends without a sync).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.channel: StepChannel | None = None  # rank 0 of a tensor-parallel group
        self._sizes = sizes
        self.device_thread: DeviceThread | None = None  # the CPU's, when steps overlap
        # The CPU's doubled host buffers, when steps overlap.
        self._slots: list[tuple[StepInputs, StepArrays]] = []
        self.adapters: AdapterRegistry | None = None  # the resident LoRA adapters, if any

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

    def enable_overlap(self) -> None:
        """Overlapped steps (engine/core/step_loop.py): on the CPU, launched work runs on a device
        thread and the host buffers are doubled, so the host fills step N+1's while step N
        reads its own. (On CUDA the upload event already guards the pinned buffers.)"""
        if self.device.type != "cpu" or self.device_thread is not None:
            return
        self.device_thread = DeviceThread()
        spare = StepInputs.allocate(*self._sizes, torch.device("cpu"), False, self.groups)
        self._slots = [(self.host, self.arrays), (spare, spare.numpy())]

    def run_on_device(self, work: Callable[[], None]) -> None:
        """Run `work` (a write of weights the steps read) after every step launched so far:
        on the CPU's device thread when steps overlap, waiting for it; else now (CUDA queues
        it on the stream behind them)."""
        if self.device_thread is None:
            work()
        else:
            self.device_thread.submit(work).result()

    def share_slot(self, slot: int, file: AdapterFile | None) -> None:
        """Tensor parallel: every other rank writes `file` into LoRA slot `slot` too."""
        if self.channel is not None:
            share_slot(self.channel, slot, file)

    def close(self) -> None:
        if self.device_thread is not None:
            self.device_thread.close()
            self.device_thread = None

    def run(self, batch: ScheduledBatch) -> Sampled:
        """One step, start to finish."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, pending: PendingInputs | None = None) -> LaunchedStep:
        """Write the step's inputs into the host buffers and enqueue its forward and sampling
        without waiting for the device (engine/execution/launched_step.py). Rows listed in
        `pending` read their input token from the previous step's samples, on the device
        (never with a draft to verify, whose tokens become rows of their own here)."""
        batch, verifying = as_decode_rows(batch)
        if self._slots:  # the CPU's step tensors are the host buffers: switch to the other pair
            self.host, self.arrays = self._slots[1 if self.host is self._slots[0][0] else 0]
            self.inputs = self.host
        num_seqs = len(batch.requests)
        width = max([len(r.pages) for r in batch.requests])  # the widest row the step reads
        lora = None
        if self.adapters is not None:
            lora = self.adapters.step(batch.requests, batch.query_lens, self.device)
        size = self._graph_size(batch, lora)
        step = self._prepare(batch, width, graph_rows=size)
        routing = None
        if step.sampling or step.scoring:
            asked = any([r.params.routed_experts for r in batch.requests])
            routing = routing_record(self.model.config.moe, asked)
        self._send(step, size or 0, None if lora is None else batch.requests)
        sampling = None
        if step.sampling:  # the step's SamplingBatch, in the buffers this launch fills
            args = (_block_table(batch), self.host, self.arrays, self.inputs)
            sampling = self.sampling_inputs.batch(step.sampling, *args)
        scoring = ScoredRows.build(step.scoring, self.device) if step.scoring else None
        lm_head = sampling is not None or scoring is not None
        rows = self._sample_rows(step) if lm_head and not step.rows_are_tokens else None
        if pending is not None:
            pending.upload(self.device)
        # NOTE: the work may run on the device thread after the next launch has switched
        # buffers: it reads only what is bound here, never self.host or self.arrays.
        if size is not None:  # a decode step with a graph to replay
            work = self._graphed_work(num_seqs, width, rows, pending, sampling, routing)
        else:
            work = self._eager_work(step, rows, pending, lora, routing, sampling, scoring)
        submit = self.device_thread.submit if self.device_thread is not None else run_now
        launched = LaunchedStep(step.sampling, submit(work), scoring, verifying)
        if sampling is not None and sampling.grammar is not None:
            sampling.grammar.fill()  # while the forward runs (unless the sampler did already)
        return launched

    def _graph_size(self, batch: ScheduledBatch, lora: LoraStep | None) -> int | None:
        """The graph bucket a decode step replays; None: the step runs eagerly. A decode step
        replays a graph unless it scores prompt positions (a 1-token chunk) or runs LoRA
        adapters (the graphs hold the base model only)."""
        graphs, num_seqs = self.graphs, len(batch.requests)
        if graphs is None or lora is not None or batch.num_tokens != num_seqs:
            return None
        if any([r.prompt_scores is not None for r in batch.requests]):
            return None
        return graphs.bucket(num_seqs)

    def _graphed_work(
        self,
        num_seqs: int,
        width: int,
        rows: torch.Tensor | None,
        pending: PendingInputs | None,
        sampling: SamplingBatch | None,
        routing: list[torch.Tensor] | None,
    ) -> Callable[[], StepResult | None]:
        assert self.graphs is not None
        args = (self.host, self.arrays, num_seqs, width, rows, pending, self._record_upload)
        outputs_of = graph_outputs(self.graphs, *args)
        sampler = self.sampler

        def work() -> StepResult | None:
            logits, routed = outputs_of()  # routed: an MoE model's, always recorded
            if sampling is None:
                return None
            routed = None if routing is None else routed  # copied to the host when asked
            return to_host_async(sampler(logits, sampling), None, routed)

        return work

    def _eager_work(
        self,
        step: PreparedStep,
        rows: torch.Tensor | None,
        pending: PendingInputs | None,
        lora: LoraStep | None,
        routing: list[torch.Tensor] | None,
        sampling: SamplingBatch | None,
        scoring: ScoredRows | None,
    ) -> Callable[[], StepResult | None]:
        self._upload(step)
        inputs = forward_inputs(self.inputs, self.arrays, *step.shape)
        model, sampler = self.model, self.sampler
        hidden_of = eager_hidden(model, self.kv_caches, inputs, rows, pending, lora, routing)
        num_sampled, num_rows = step.num_rows, step.num_rows + step.num_scored

        def work() -> StepResult | None:
            hidden = hidden_of()  # [sampled rows, then scored rows, hidden] with an LM head
            if sampling is None and scoring is None:
                return None
            out = scores = routed = None
            if sampling is not None:
                out = sampler(model.compute_logits(hidden[:num_sampled]), sampling)
            if scoring is not None:
                scores = score_rows(model, hidden[num_sampled:], scoring)
            if routing is not None:
                routed = row_routing(routing, rows, num_rows)
            return to_host_async(out, scores, routed)

        return work

    def collect(self, launched: LaunchedStep) -> Sampled:
        """Wait for a launched step and bring its samples to the host."""
        result = launched.result.result()  # re-raises what failed on the device thread
        if result is None:
            return Sampled([], [], None, None, None)
        if result.ready is not None:
            result.ready.synchronize()
        sampled = sampled_on_host(launched.sampling, result.host)
        sampled.verifying = launched.verifying
        routed = None if result.routed is None else host_rows(result.routed)
        first = len(launched.sampling)  # the scored rows' routing follows the sampled rows'
        if routed is not None and first:
            sampled.routed_experts = routed[:first]
        if launched.scoring is not None and result.scores is not None:
            packed, row = result.scores.tolist(), 0
            for req, span in launched.scoring.spans:
                rows = packed[row : row + span.count]
                sampled.prompt_scores.append((req, span.first, rows))
                if routed is not None:
                    scored = routed[first + row : first + row + span.count]
                    sampled.prompt_routing.append((req, span.first, scored))
                row += span.count
        return sampled

    def _send(self, step: PreparedStep, graph_size: int, lora: list[Request] | None) -> None:
        if self.channel is None:
            return
        # `lora`: the step's requests when some run an adapter: their slots go too.
        slots = self.adapters.request_slots(lora) if lora and self.adapters else None
        header = StepHeader(
            Op.STEP,
            step.num_tokens,
            step.num_seqs,
            step.width,
            graph_size,
            0 if graph_size else step.num_rows,  # a graphed step gathers every row's logits
            step.rows_are_tokens,
        )
        header.num_scored = step.num_scored
        copies = self.pool.copy_log or []
        header.num_copies = len(copies)
        header.lora = slots is not None
        self.channel.send(header, copies, slots)
        copies.clear()

    @torch.inference_mode()
    def follow(
        self, header: StepHeader, copies: list[tuple[int, int]], lora: LoraStep | None = None
    ) -> None:
        """A worker rank: run the step rank 0 described (its inputs are in the host buffers;
        `lora`, its adapters), joining every collective rank 0's `run` makes."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        for src, dst in copies:
            self.pool.copy_page(src, dst)
        if header.graph_size:
            assert self.graphs is not None
            self.graphs.run(self.host, self.arrays, header.num_seqs, header.width)
            self._record_upload()
            return
        h = header  # no requests on a worker: their numbers only
        step = PreparedStep(h.num_tokens, h.num_seqs, h.width, [], h.rows_are_tokens, 0, [], 0)
        step.num_rows, step.num_scored = h.num_rows, h.num_scored
        hidden = self._forward(step, lora)
        if step.num_rows + step.num_scored:
            if not step.rows_are_tokens:
                hidden = hidden[self._sample_rows(step)]
            if step.num_rows:
                self.model.compute_logits(hidden[: step.num_rows])
            if step.num_scored:
                follow_scored_rows(self.model, hidden[step.num_rows :])

    def _record_upload(self) -> None:
        if self._uploaded is not None:
            self._uploaded.record()

    def _sample_rows(self, step: PreparedStep) -> torch.Tensor:
        rows = step.num_rows + step.num_scored
        if self.inputs is not self.host:
            self.inputs.sample_rows[:rows].copy_(self.host.sample_rows[:rows], non_blocking=True)
        return self.inputs.sample_rows[:rows]

    def _forward(self, step: PreparedStep, lora: LoraStep | None = None) -> torch.Tensor:
        """The eager forward of any step: [tokens, hidden]."""
        self._upload(step)
        ids, positions, meta = forward_inputs(self.inputs, self.arrays, *step.shape)
        return self.model(ids, positions, meta, self.kv_caches, lora)

    def _upload(self, step: PreparedStep) -> None:
        num_seqs, width = step.num_seqs, step.width
        if self.inputs is not self.host:
            self.inputs.copy_from(self.host, step.num_tokens, num_seqs, num_seqs * width)
        self._record_upload()

    def _prepare(
        self, batch: ScheduledBatch, width: int, graph_rows: int | None = None
    ) -> PreparedStep:
        """Write the step's inputs into the host buffers (no tensors are created here).
        A graphed step's block table is page-major for its `graph_rows` (padded) rows.

        The rows of the block table are gathered from the scheduler's BlockTable (kept as
        pages are added) with one numpy index: no per-row rewrite."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's uploads have been read
        reqs, table = batch.requests, _block_table(batch)
        slots = np.array([r.slot for r in reqs], dtype=np.int64)
        if batch.num_tokens == len(reqs):
            fill_decode(self.arrays, self.page_size, reqs, table.pages, slots)
        else:
            fill_packed(self.arrays, self.page_size, reqs, batch.query_lens, table.pages, slots)
        if graph_rows is None:
            tables = self.arrays.block_table(len(reqs), width)
        else:
            tables = self.arrays.block_table(graph_rows, width, page_major=True)[: len(reqs)]
        # Entries past a row's pages are whatever the slot held: valid ids, never attended.
        tables[...] = table.pages[slots, :width]
        if table.group_pages:  # the other KV groups' slots and tables
            args = (table.group_pages, slots, batch.query_lens, width, graph_rows)
            fill_groups(self.arrays, self.page_size, *args)
        return lm_head_rows(batch, self.arrays, width)


def _block_table(batch: ScheduledBatch) -> BlockTable:
    assert batch.block_table is not None, "a batch from the Scheduler carries its block table"
    return batch.block_table
