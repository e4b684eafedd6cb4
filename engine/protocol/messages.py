"""The pipe protocol between the service process and the engine process.

Standard library only: both sides import this module, and the service never imports torch.
Everything here is plain data (dataclasses of builtins) so it pickles across the pipe.

Service -> engine: AddRequest, AbortRequests, UpdateWeights, InitWeightTransfer, Sleep, Wake,
CheckConstraint, AbandonCheck, GetState, Shutdown, LoadAdapter, UnloadAdapter, ListAdapters,
FlushCache. Engine -> service: Ready, StepOutput (one per engine step), WeightsProgress (for an
UpdateWeights), WeightTransferJoined (for an InitWeightTransfer), SleepOutcome (for a Sleep or a
Wake), ConstraintChecked (for a CheckConstraint), Heartbeat (while idle, and in answer to
GetState), AdapterOutcome (for each adapter message), CacheFlushed (for a FlushCache),
EngineDead (the last message of a dying engine). StepOutput and Heartbeat carry the prefix
cache's events since the last one. The admin messages (weight updates and transfers, sleep and
wake, adapters) live in engine/protocol/admin_messages.py, the cache's events and FlushCache in
engine/protocol/kv_events.py, EngineStats in engine/protocol/engine_stats.py, SamplingParams in
engine/protocol/sampling_params.py; all are re-exported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engine.protocol.admin_messages import (
    SLEEP_LEVELS,
    AdapterOutcome,
    AdapterState,
    DistributedTensors,
    InflightPolicy,
    InitWeightTransfer,
    ListAdapters,
    LoadAdapter,
    Sleep,
    SleepOutcome,
    TensorRef,
    TensorSpec,
    TransferGroupSpec,
    UnloadAdapter,
    UpdateWeights,
    Wake,
    WeightsPhase,
    WeightsProgress,
    WeightTransferJoined,
)
from engine.protocol.engine_stats import EngineStats
from engine.protocol.error_code import ErrorCode
from engine.protocol.kv_events import CacheFlushed, FlushCache, KvEvent
from engine.protocol.sampling_params import (
    CONSTRAINT_KINDS,
    GREEDY_TEMPERATURE,
    LOGIT_BIAS_RANGE,
    MAX_BAD_WORD_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    MAX_LOGIT_BIAS,
    MAX_SUPPORT_TOP_K,
    MAX_TOKEN_ID_LIST,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    SUPPORT_TIES,
    Constraint,
    LogprobMode,
    SamplingParams,
)

MAX_POLICY_VERSION = 2**64 - 1


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos or a stop token id
    STOP_STRING = "stop_string"  # matched in the service
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"  # the caller cancelled or disconnected
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ABORTED = "aborted"  # an admin action (weight update with ABORT, shutdown)
    ERROR = "error"  # bad input found by the engine, or an engine failure


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1  # samples of this prompt; outputs carry index 0..n-1
    priority: int = 0  # higher runs first; FCFS within a priority
    deadline: float | None = None  # absolute time.time(); enforced while queued too
    min_policy_version: int | None = None


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]
    reason: FinishReason = FinishReason.CANCELLED
    index: int | None = None  # only this sample of each request (a stop string matched on it)


@dataclass(frozen=True)
class CheckConstraint:
    """Compile a structured-output constraint (or find it compiled) before a request that
    uses it is added: the engine answers ConstraintChecked, and keeps the grammar cached."""

    check_id: str
    constraint: Constraint
    caller: str = ""  # who asks (the gRPC peer): compiles are shared out fairly between callers


@dataclass(frozen=True)
class AbandonCheck:
    """The CheckConstraint's caller left: answer nothing, and cancel the compile if nothing
    else waits for it."""

    check_id: str


@dataclass(frozen=True)
class GetState:
    """Asks for a Heartbeat now."""


@dataclass(frozen=True)
class Shutdown:
    """Abort everything in flight (ABORTED), publish the final outputs and exit."""


# ---- engine -> service ----


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the name callers see (the checkpoint directory's name, or "demo")
    path: str  # the resolved checkpoint directory; the service loads tokenizer.json from it
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    page_size: int
    total_pages: int
    policy_version: int
    max_num_seqs: int  # also the largest n a request may ask for
    # Mixture-of-experts models (0 for a dense one): the layers whose MLP is routed, the
    # experts each token goes to in each, and the experts of each layer. They size the
    # routed experts a request may ask for.
    moe_layers: int = 0
    moe_top_k: int = 0
    num_experts: int = 0


@dataclass(frozen=True)
class RequestMetrics:
    """Seconds, measured in the engine."""

    queue_time: float  # arrival -> first scheduled
    time_to_first_token: float  # arrival -> first token sampled
    decode_time: float  # first token -> finish
    # Speculative decoding: tokens proposed for this sequence, and how many of them were
    # accepted (each accepted one is an output token that took no forward pass of its own).
    proposed_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class PromptLogprobs:
    """The log-probability of each prompt token given the ones before it, from position
    `start` on: logprobs[i] belongs to prompt position start + i, as top_logprobs[i] (the most
    likely tokens there, when asked for) does."""

    start: int
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # routed_experts[i]: with SamplingParams.routed_experts, the expert ids each MoE layer chose
    # at position start + i - 1 (whose logits score position start + i), flattened [layer, k]
    routed_experts: list[list[int]] | None = None


@dataclass
class RequestOutput:
    """What one request (one index of it) gained in one engine step.

    `new_token_ids[i]` pairs with `logprobs[i]` and `top_logprobs[i]` (when asked for). The
    request's first output carries its usage counts, so the service can send `started`; the
    last one carries `finish_reason` (and `error` text for ERROR/ABORTED) and `metrics`. With
    prompt logprobs asked for, the first output of index 0 carries them.

    Not frozen, and pickled as its constructor's arguments: every running request sends one
    per step, and this is the cheapest form to rebuild (a third of the default's unpickling
    time; a frozen dataclass's __init__ costs more than the default). Treat it as read-only.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    policy_version: int
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # sampling_support[i]: the ids new_token_ids[i] could have been drawn from, most likely
    # first; [] when nothing truncated the distribution (every token). When asked for.
    sampling_support: list[list[int]] | None = None
    # routed_experts[i]: for new_token_ids[i], the expert ids each MoE layer's router chose at
    # the position whose logits produced it, flattened [MoE layer, k] (highest weight first).
    # When asked for (SamplingParams.routed_experts).
    routed_experts: list[list[int]] | None = None
    # Speculative decoding: (proposed, accepted) tokens so far, on every token output once the
    # request has had a proposal (the final output's metrics repeat them): the service reports
    # them for a sample it ends at a stop string before the engine's last output.
    spec_tokens: tuple[int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple[type[RequestOutput], tuple[Any, ...]]:
        # NOTE: __init__ sets the fields in declaration order, so __dict__ lists them in the
        # order __init__ takes them.
        return RequestOutput, tuple(self.__dict__.values())


@dataclass(frozen=True)
class Ready:
    info: ModelInfo


@dataclass
class TokenColumns:
    """A step's plain rows as columns: request indexes that gained one token, did not end and
    asked for no logprobs (most rows of a decode step). Row i is the RequestOutput that
    `outputs()` builds; the columns pickle in a tenth of the time the objects do."""

    request_ids: list[str]
    indexes: list[int]
    token_ids: list[int]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    completion_tokens: list[int]
    policy_version: int

    def outputs(self) -> list[RequestOutput]:
        version = self.policy_version
        return [
            RequestOutput(request_id, index, [token], version, None, None, None, None, p, c, n)
            for request_id, index, token, p, c, n in zip(
                self.request_ids,
                self.indexes,
                self.token_ids,
                self.prompt_tokens,
                self.cached_tokens,
                self.completion_tokens,
                strict=True,
            )
        ]


@dataclass(frozen=True)
class StepOutput:
    """One engine step's outputs: `outputs`, then the rows in `columns` (all_outputs())."""

    outputs: list[RequestOutput]
    stats: EngineStats
    columns: TokenColumns | None = None
    kv_events: list[KvEvent] | None = None  # the prefix cache's, in order (None: none)

    def all_outputs(self) -> list[RequestOutput]:
        return (self.outputs + self.columns.outputs()) if self.columns else self.outputs


@dataclass(frozen=True)
class ConstraintChecked:
    """The answer to a CheckConstraint: `error_code` None when the constraint compiled, else
    what is wrong (INVALID_ARGUMENT: the constraint; FAILED_PRECONDITION: the model's vocabulary
    cannot be used; UNAVAILABLE: the engine was lost) and `message`."""

    check_id: str
    error_code: ErrorCode | None = None
    message: str = ""


@dataclass(frozen=True)
class Heartbeat:
    stats: EngineStats
    kv_events: list[KvEvent] | None = None  # as StepOutput's


@dataclass(frozen=True)
class EngineDead:
    reason: str
    traceback: str = ""


ToEngine = (
    AddRequest
    | AbortRequests
    | UpdateWeights
    | InitWeightTransfer
    | Sleep
    | Wake
    | CheckConstraint
    | AbandonCheck
    | GetState
    | Shutdown
    | LoadAdapter
    | UnloadAdapter
    | ListAdapters
    | FlushCache
)
FromEngine = (
    Ready
    | StepOutput
    | WeightsProgress
    | WeightTransferJoined
    | SleepOutcome
    | ConstraintChecked
    | Heartbeat
    | EngineDead
    | AdapterOutcome
    | CacheFlushed
)
__all__ = [
    "FinishReason",
    "SamplingParams",
    "AddRequest",
    "AbortRequests",
    "InflightPolicy",
    "LogprobMode",
    "TensorRef",
    "UpdateWeights",
    "Sleep",
    "Wake",
    "SleepOutcome",
    "SLEEP_LEVELS",
    "TensorSpec",
    "DistributedTensors",
    "TransferGroupSpec",
    "InitWeightTransfer",
    "WeightTransferJoined",
    "WeightsPhase",
    "WeightsProgress",
    "Constraint",
    "CheckConstraint",
    "AbandonCheck",
    "ConstraintChecked",
    "GetState",
    "Shutdown",
    "ModelInfo",
    "EngineStats",
    "RequestMetrics",
    "PromptLogprobs",
    "RequestOutput",
    "Ready",
    "StepOutput",
    "TokenColumns",
    "Heartbeat",
    "EngineDead",
    "ToEngine",
    "FromEngine",
    "MAX_TOP_LOGPROBS",
    "MAX_SUPPORT_TOP_K",
    "MAX_LOGIT_BIAS",
    "LOGIT_BIAS_RANGE",
    "MAX_TOKEN_ID_LIST",
    "MAX_BAD_WORD_IDS",
    "MAX_BAD_WORD_TOKENS",
    "MAX_CHOICES",
    "MAX_CONSTRAINT_BYTES",
    "CONSTRAINT_KINDS",
    "SUPPORT_TIES",
    "MAX_POLICY_VERSION",
    "GREEDY_TEMPERATURE",
    "REPETITION_PENALTY_RANGE",
    # LoRA adapters
    "AdapterState",
    "LoadAdapter",
    "UnloadAdapter",
    "ListAdapters",
    "AdapterOutcome",
]
