"""Decode steps captured as CUDA graphs for padded batch-size buckets, then replayed.

A decode step (every sequence feeds one token) of n sequences runs as the graph of the
smallest bucket >= n. Rows n..bucket are padding: token 0 at position 0, a context of one
token on the pool's scratch page, their KV written to the scratch slot; their logits are
dropped. Graphs are captured at start, largest first, into one memory pool. The captured
function (embed -> layers -> norm -> LM head) reads only the static buffers in `inputs`, whose
block tables are padded to the widest sequence the model allows, so shapes never change.

Mixture-of-experts models are captured with their experts' grouped-GEMM kernel (the torch path
reads per-expert counts on the host: engine/moe/experts.py), and their graphs always record every
row's routed experts as a second output, so a step whose requests ask for them
(engine/moe/routed_experts.py) replays a graph too.

With `capture=False` the same padded step runs eagerly: on the CPU that checks the padding
and the capture-safe forward; with `compile=True` the step is `torch.compile`d either way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from engine.attention.backend import KVCache
from engine.attention.metadata import AttentionMetadata
from engine.execution.step_inputs import StepArrays, StepInputs
from engine.kv_cache.page_pool import PagePool
from engine.models.base import CausalLM
from engine.moe.routed_experts import stack_routing

MAX_GRAPH_BATCH = 512  # decode batches above this run eagerly

# A step's logits [rows, vocab] float32 and, for an MoE model, its routed experts [rows, MoE
# layers, top_k] int32 (None for a dense model).
GraphOutput = tuple[torch.Tensor, torch.Tensor | None]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond; the last one is max_batch."""
    standard = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_batch, 16)]
    return [size for size in standard if size < max_batch] + [max_batch]


def pad_decode_rows(
    arrays: StepArrays, num_seqs: int, size: int, width: int, scratch_page: int, page_size: int
) -> None:
    """Make rows num_seqs..size of a filled decode step harmless padding (host arrays; the
    block table is page-major, `width` pages wide).

    NOTE: every padded row must write its KV to the scratch slot: a stale slot left by an
    earlier, larger step would overwrite a live request's page.
    """
    arrays.input_ids[num_seqs:size] = 0
    arrays.positions[num_seqs:size] = 0
    arrays.slot_mapping[num_seqs:size] = scratch_page * page_size
    arrays.seq_lens[num_seqs:size] = 1
    arrays.query_start_loc[num_seqs + 1 : size + 1] = np.arange(num_seqs + 1, size + 1)
    arrays.block_table(size, width, page_major=True)[num_seqs:size] = scratch_page
    arrays.group_slots[:, num_seqs:size] = scratch_page * page_size  # other KV groups' too
    for group in range(1, arrays.group_slots.shape[0] + 1):
        arrays.group_table(group, size, width, page_major=True)[num_seqs:size] = scratch_page


class CUDAGraphRunner:
    """Runs decode steps of up to `max_batch` sequences from static, padded buffers."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        pool: PagePool,
        max_batch: int,
        max_pages: int,
        capture: bool,
        compile: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.pool = pool
        self.max_pages = max_pages  # block-table width every graph is captured at
        self.batch_sizes = graph_batch_sizes(min(max_batch, MAX_GRAPH_BATCH))
        self.capture_enabled = capture
        largest, groups = self.batch_sizes[-1], pool.groups.num_groups
        self.inputs = StepInputs.allocate(
            largest, largest, max_pages, 0, pool.device, False, groups
        )
        self._pad_all()
        self.records_routing = model.config.moe is not None
        self.forward: Callable[[int], GraphOutput] = self._forward
        if compile:
            _allow_recompiles(len(self.batch_sizes))
            self.forward = torch.compile(self._forward, dynamic=False)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphOutput] = {}  # what each graph writes

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def bucket(self, num_seqs: int) -> int | None:
        """The padded size a decode step of num_seqs runs at; None = too big, run eagerly."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (smaller graphs reuse
        the larger ones' memory). Each size runs once eagerly first: Triton compiles its
        kernels, cuBLAS picks its algorithms and torch.compile traces outside the capture."""
        if not self.capture_enabled:
            return
        self._pad_all()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            self.forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(
        self,
        host: StepInputs,
        arrays: StepArrays,
        num_seqs: int,
        width: int,
        patch: Callable[[StepInputs], None] | None = None,
    ) -> GraphOutput:
        """Logits [num_seqs, vocab] (and routed experts) of a decode step whose rows the caller
        filled in `host`, with a page-major block table `width` pages wide for
        `bucket(num_seqs)` rows. Valid until the next run. `patch` edits the static inputs
        after the upload (an overlapped step writes the previous step's samples into its input
        ids there)."""
        size = self.bucket(num_seqs)
        assert size is not None, f"a decode step of {num_seqs} is above the largest graph"
        assert width <= self.max_pages
        pad_decode_rows(arrays, num_seqs, size, width, *self._scratch)
        # Pages past `width` keep stale (valid) ids: no sequence of this step reaches them.
        self.inputs.copy_from(host, size, size, size * width)
        if patch is not None:
            patch(self.inputs)
        graph = self.graphs.get(size)
        if graph is None:
            logits, routed = self.forward(size)
        else:
            # NOTE: graphs share one pool: an output is only valid until another graph replays.
            graph.replay()
            logits, routed = self.outputs[size]
        return logits[:num_seqs], None if routed is None else routed[:num_seqs]

    def _forward(self, size: int) -> GraphOutput:
        """The captured step: reads only `inputs`; every shape is a function of `size`."""
        inp = self.inputs
        meta = AttentionMetadata(
            query_lens=[1] * size,
            context_lens=[],  # not read by a decode-only step: seq_lens holds them
            slot_mapping=inp.slot_mapping[:size],
            block_tables=inp.block_table(size, self.max_pages, page_major=True),
            seq_lens=inp.seq_lens[:size],
            query_start_loc=inp.query_start_loc[: size + 1],
            max_query_len=1,
            max_context_len=self.max_pages * self.pool.page_size,
            decode_only=True,
        )
        if inp.group_slots.shape[0]:  # the other KV groups' tables, page-major too
            inp.group_metas(meta, size, self.max_pages, page_major=True)
        routing: list[torch.Tensor] | None = [] if self.records_routing else None
        ids, positions = inp.input_ids[:size], inp.positions[:size]
        hidden = self.model(ids, positions, meta, self.kv_caches, None, routing)
        logits = self.model.compute_logits(hidden)
        return logits, None if routing is None else stack_routing(routing)

    @property
    def _scratch(self) -> tuple[int, int]:
        return self.pool.scratch_page, self.pool.page_size

    def _pad_all(self) -> None:
        """Every row padding: what warm-up and capture run on (they write only scratch KV)."""
        inp = self.inputs
        inp.input_ids.zero_()
        inp.positions.zero_()
        inp.slot_mapping.fill_(self.pool.scratch_slot)
        inp.seq_lens.fill_(1)
        inp.query_start_loc.copy_(torch.arange(inp.query_start_loc.shape[0]))
        inp.block_tables.fill_(self.pool.scratch_page)
        inp.group_slots.fill_(self.pool.scratch_slot)
        inp.group_tables.fill_(self.pool.scratch_page)


def _allow_recompiles(count: int) -> None:
    """One compile per bucket: dynamo's per-function recompile limit (8 by default) would
    otherwise leave the larger batch sizes uncompiled, with only a warning."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), count + 8))
