"""A step in flight: launched by ModelRunner.launch, brought to the host by ModelRunner.collect.

Launching writes the step's inputs and enqueues its forward and sampling; it does not wait for
the device. On CUDA the kernels are queued on the current stream and the sampled values are
copied, without blocking, into pinned host memory behind an event. The CPU has no asynchronous
device, so the launched work runs on one DeviceThread (torch ops release the GIL): the host
goes on scheduling while it computes. Without a device thread the work runs at launch.

A row of the next step whose input token is this step's not-yet-known sample reads it on the
device: PendingInputs scatters this step's sampled ids into the next step's input ids.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from engine.attention.backend import KVCache
from engine.attention.metadata import AttentionMetadata
from engine.execution.cuda_graph import CUDAGraphRunner, GraphOutput
from engine.execution.prompt_scoring import ScoredRows
from engine.execution.step_inputs import StepArrays, StepInputs
from engine.layers.parallel_linear import LoraPass
from engine.models.base import CausalLM
from engine.sampling.sampler import SamplerOutput
from engine.scheduling.request import Request

T = TypeVar("T")


@dataclass
class Sampled:
    """The tokens sampled this step, one per sampling request, on the host (with what the
    rows asked for); and the prompt positions scored, per request: (request, first position,
    one row per position), with their routed experts alike when recorded."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    prompt_scores: list[tuple[Request, int, list[list[float]]]] = field(default_factory=list)
    # Per row when asked for: the ids it could have drawn ([]: every token; None: more tie at
    # the k-th logit than the sampler returned)
    support: list[list[int] | None] | None = None
    # Per row when some row asked (engine/moe/routed_experts.py): each MoE layer's expert
    # ids at the position the row sampled from, flattened [MoE layer, k]
    routed_experts: list[list[int]] | None = None
    # The routed experts of the prompt positions scored, when recorded: as prompt_scores
    prompt_routing: list[tuple[Request, int, list[list[int]]]] = field(default_factory=list)
    # Speculative decoding: the rows that verify a draft, by the row's request (a view of the
    # request as of that position: engine/execution/draft_rows.py) -> the request itself
    verifying: dict[Request, Request] = field(default_factory=dict)

    def rows(self, rows: list[int]) -> Sampled:
        """The sampled rows `rows` (the prompt scores all kept: ended requests skip theirs)."""
        if len(rows) == len(self.requests):
            return self

        def pick(values: list[T] | None) -> list[T] | None:
            return None if values is None else [values[row] for row in rows]

        return Sampled(
            [self.requests[row] for row in rows],
            [self.token_ids[row] for row in rows],
            pick(self.logprobs),
            pick(self.top_ids),
            pick(self.top_logprobs),
            self.prompt_scores,
            pick(self.support),
            pick(self.routed_experts),
            self.prompt_routing,
            self.verifying,
        )


@dataclass
class StepResult:
    """What a launched step sampled (`host`) and scored (`scores`, engine/execution/
    prompt_scoring.py), on the host once `ready` has passed (CUDA); and the sampled ids on the
    device for the next step's pending inputs."""

    host: SamplerOutput | None
    token_ids: torch.Tensor | None  # [rows] int64, on the device
    scores: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    routed: torch.Tensor | None = None  # [rows, MoE layers, top_k] int32, when recorded


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued or running. `result` resolves (on the
    device thread) once they have been enqueued or, on the CPU, computed; None when no row
    samples."""

    sampling: list[Request]  # one per sampled row, as Sampled.requests will be
    result: Future[StepResult | None]
    scoring: ScoredRows | None = None
    verifying: dict[Request, Request] = field(default_factory=dict)  # as Sampled's


@dataclass
class PendingInputs:
    """Input tokens of a step that the previous step is still sampling: input token
    `positions[i]` (packed index) is row `rows[i]` of `previous`'s sampled ids."""

    previous: LaunchedStep
    positions: list[int]
    rows: list[int]
    _indices: torch.Tensor | None = None  # [2, n] on the device, once uploaded

    def upload(self, device: torch.device) -> None:
        """Copy (positions, rows) to the device without blocking (pinned on CUDA: a pageable
        copy would wait for the queued previous step). At launch, on the host thread."""
        pin = device.type == "cuda"
        both = torch.tensor([self.positions, self.rows], dtype=torch.int64, pin_memory=pin)
        self._indices = both.to(device, non_blocking=True)

    def scatter(self, input_ids: torch.Tensor) -> None:
        """Write the previous step's sampled ids into `input_ids` (device work, in stream
        order after the previous step's sampling)."""
        result = self.previous.result.result()  # done: launched work runs in order
        assert result is not None and result.token_ids is not None, "it sampled nothing"
        assert self._indices is not None, "scatter before upload"
        positions, rows = self._indices
        # NOTE: a row with no possible token sampled NO_TOKEN: read as id 0, in a row that is
        # discarded (its request ends with ERROR when the previous step is collected). Clamped
        # here, on the overlapped loop's path only: the plain loop pays nothing for it.
        ids = result.token_ids.index_select(0, rows).clamp_(min=0)
        input_ids.index_copy_(0, positions, ids)


def graph_outputs(
    graphs: CUDAGraphRunner,
    host: StepInputs,
    arrays: StepArrays,
    num_seqs: int,
    width: int,
    rows: torch.Tensor | None,
    pending: PendingInputs | None,
    after_upload: Callable[[], None],
) -> Callable[[], GraphOutput]:
    """The device work of a graphed decode step: upload, write the pending ids into the static
    inputs, replay. Its logits and routed experts: every row's, or those of `rows`."""

    def patch(inputs: StepInputs) -> None:
        if pending is not None:
            pending.scatter(inputs.input_ids)

    def outputs() -> GraphOutput:
        logits, routed = graphs.run(host, arrays, num_seqs, width, patch if pending else None)
        after_upload()
        if rows is None:
            return logits, routed
        return logits[rows], None if routed is None else routed[rows]

    return outputs


def eager_hidden(
    model: CausalLM,
    kv_caches: list[KVCache],
    inputs: tuple[torch.Tensor, torch.Tensor, AttentionMetadata],
    rows: torch.Tensor | None,
    pending: PendingInputs | None,
    lora: LoraPass | None = None,
    routing: list[torch.Tensor] | None = None,
) -> Callable[[], torch.Tensor]:
    """The device work of an eager step on uploaded inputs (ids, positions, metadata): write
    the pending ids, forward (with the step's LoRA adapters, if any; recording the MoE layers'
    expert ids in `routing`, if given); the hidden states of `rows` (or of every token)."""
    ids, positions, meta = inputs

    def hidden() -> torch.Tensor:
        if pending is not None:
            pending.scatter(ids)
        out = model(ids, positions, meta, kv_caches, lora, routing)
        return out if rows is None else out[rows]

    return hidden


def sampled_ids(out: SamplerOutput) -> torch.Tensor:
    """[rows] int64 token ids of a sampler output (column 0 when logprobs are packed in); a row
    with no possible token holds NO_TOKEN (PendingInputs.scatter reads it as id 0)."""
    return out.values if out.values.dim() == 1 else out.values[:, 0].to(torch.int64)


def to_host_async(
    out: SamplerOutput | None, scores: torch.Tensor | None, routed: torch.Tensor | None = None
) -> StepResult | None:
    """Start the device-to-host copies of a step's sampled values, prompt scores and routed
    experts (CUDA: pinned memory and an event, nothing waits; CPU: they are already on the
    host)."""
    either = out.values if out is not None else scores
    if either is None:
        return None
    ids = None if out is None else sampled_ids(out)
    if either.device.type != "cuda":
        return StepResult(out, ids, scores, None, routed)
    host = None if out is None else SamplerOutput(_pinned_copy(out.values), out.num_top_logprobs)
    host_scores = None if scores is None else _pinned_copy(scores)
    host_routed = None if routed is None else _pinned_copy(routed)
    ready = torch.cuda.Event()
    ready.record()
    return StepResult(host, ids, host_scores, ready, host_routed)


def sampled_on_host(sampling: list[Request], out: SamplerOutput | None) -> Sampled:
    """The Sampled of a step's sampler output, once on the host."""
    if out is None:
        return Sampled([], [], None, None, None)
    if out.values.dim() == 1:
        return Sampled(sampling, out.values.tolist(), None, None, None)
    packed = out.values.tolist()
    token_ids = [int(row[0]) for row in packed]
    logprobs = [row[1] for row in packed]
    top_ids = top_lps = None
    if k := out.num_top_logprobs:
        top_ids = [[int(t) for t in row[2 : 2 + k]] for row in packed]
        top_lps = [row[2 + k : 2 + 2 * k] for row in packed]
    sampled = Sampled(sampling, token_ids, logprobs, top_ids, top_lps)
    if width := out.support_width:
        sampled.support = [_support(row[2 + 2 * k :], width) for row in packed]
    return sampled


def _support(columns: list[float], width: int) -> list[int] | None:
    """A row's sampling support from its packed columns (size, then `width` ids): [] for every
    token, None when more ids tie than the columns hold."""
    size = int(columns[0])
    if size > width:
        return None
    return [int(t) for t in columns[1 : 1 + size]] if size > 0 else []


def _pinned_copy(values: torch.Tensor) -> torch.Tensor:
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return host.copy_(values, non_blocking=True)


class DeviceThread:
    """The CPU's stand-in for a device queue: launched work runs here, one step at a time,
    in launch order."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-device")

    def submit(self, work: Callable[[], StepResult | None]) -> Future[StepResult | None]:
        return self._executor.submit(_inference(work))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def run_now(work: Callable[[], StepResult | None]) -> Future[StepResult | None]:
    """Run launched work at once (CUDA, whose kernels queue anyway; or no overlap)."""
    future: Future[StepResult | None] = Future()
    future.set_result(work())
    return future


def _inference(work: Callable[[], StepResult | None]) -> Callable[[], StepResult | None]:
    def run() -> StepResult | None:
        with torch.inference_mode():  # thread-local: the caller's mode does not carry over
            return work()

    return run
