"""The admin part of the pipe protocol: weight updates and transfers, sleep and wake, LoRA
adapters.

Standard library only, like engine/protocol/messages.py (which re-exports every name here): both sides
import it. Service -> engine: UpdateWeights, InitWeightTransfer, Sleep, Wake, LoadAdapter,
UnloadAdapter, ListAdapters. Engine -> service: WeightsProgress (an update's events),
WeightTransferJoined (the answer to an InitWeightTransfer), SleepOutcome (the one answer to a
Sleep or a Wake), AdapterOutcome (the one answer to each adapter message).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.protocol.error_code import ErrorCode

SLEEP_LEVELS = (1, 2)  # 1: the KV cache and the prefix cache are freed; 2: the weights too


class InflightPolicy(enum.StrEnum):
    """What a weight update does to requests already running (the table in docs/service.md)."""

    DRAIN = "drain"  # admit nothing new, let running requests finish, then swap
    ABORT = "abort"  # end running requests (ABORTED, partial output kept), then swap
    CONTINUE = "continue"  # swap between two steps; running requests keep their KV
    RECOMPUTE = "recompute"  # swap, then recompute running requests' KV with the new weights


@dataclass(frozen=True)
class TensorRef:
    """One tensor's raw row-major bytes inside UpdateWeights.tensor_file."""

    name: str
    dtype: str  # safetensors names: F32, F16, BF16
    shape: tuple[int, ...]
    offset: int  # byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a trainer broadcasts in a distributed update."""

    name: str
    dtype: str  # safetensors names: F32, F16, BF16
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DistributedTensors:
    """A distributed update's tensors, in broadcast order, packed into buckets of at most
    `bucket_bytes` (engine/weights/buckets.py has the layout)."""

    tensors: tuple[TensorSpec, ...]
    bucket_bytes: int


@dataclass(frozen=True)
class TransferGroupSpec:
    """A trainer's process group to join: its TCPStore, world, and this engine's ranks in it."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int  # the group rank of tensor-parallel rank 0
    backend: str  # "gloo" or "nccl"
    group_name: str
    timeout: float  # seconds: the join and each bucket's receive


@dataclass(frozen=True)
class InitWeightTransfer:
    """Join `group` (after leaving any group held), or with None leave it; answered by one
    WeightTransferJoined."""

    transfer_id: str
    group: TransferGroupSpec | None


@dataclass(frozen=True)
class WeightTransferJoined:
    """The answer to InitWeightTransfer: `engine_ranks` joined (0: left), or error_code and
    message, with no group held."""

    transfer_id: str
    engine_ranks: int = 0
    error_code: ErrorCode | None = None
    message: str = ""


@dataclass(frozen=True)
class UpdateWeights:
    """Swap in new weights under a new policy version.

    The source is either an HF checkpoint directory (every tensor of the model, cast to the
    served dtype like at start-up) or `tensor_file` + `tensors` (any subset of the model's
    tensors, written by the service from inline chunks; dtypes must equal the served dtype).
    Large payloads travel as a file, never through the pipe.
    """

    update_id: str
    policy_version: int  # must exceed the served version; 0 = served + 1; <= MAX_POLICY_VERSION
    inflight: InflightPolicy = InflightPolicy.DRAIN
    checkpoint_dir: str | None = None
    tensor_file: str | None = None
    tensors: tuple[TensorRef, ...] = ()
    drain_timeout: float | None = None  # seconds; DRAIN fails (old weights kept) after it
    distributed: DistributedTensors | None = None  # broadcast over the joined transfer group
    complete: bool = False  # refused (FAILED_PRECONDITION) unless it replaces every tensor


class WeightsPhase(enum.StrEnum):
    PAUSED = "paused"  # in-flight handling started (in_flight = requests it concerns)
    LOADING = "loading"  # bytes/tensors read so far
    APPLIED = "applied"  # the new version is live (final)
    FAILED = "failed"  # nothing changed (final); error_code says why


@dataclass(frozen=True)
class WeightsProgress:
    update_id: str
    phase: WeightsPhase
    in_flight: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    tensors_done: int = 0
    tensors_total: int = 0
    previous_version: int = 0
    policy_version: int = 0
    aborted: int = 0
    continued: int = 0
    recomputed: int = 0
    seconds: float = 0.0
    error_code: ErrorCode | None = None  # FAILED: INVALID_ARGUMENT, FAILED_PRECONDITION,
    # OUT_OF_RANGE (the version would pass MAX_POLICY_VERSION), ABORTED, UNAVAILABLE
    message: str = ""
    replaced_all: bool = False  # APPLIED: every tensor of the model was replaced

    @property
    def final(self) -> bool:
        return self.phase in (WeightsPhase.APPLIED, WeightsPhase.FAILED)


@dataclass(frozen=True)
class Sleep:
    """Free the engine's memory until a Wake. Level 1: the KV cache and the prefix cache
    (the pool's pages); level 2: the weights too. Requests in the engine end (ABORT: reason
    ABORTED) or run to completion first (DRAIN, within `drain_timeout` seconds, else the sleep
    fails ABORTED and serving goes on). While asleep the engine refuses new requests (ABORTED
    outputs). A Sleep while asleep only deepens the level (2 after 1); never shallower."""

    sleep_id: str
    level: int = 1  # one of SLEEP_LEVELS
    inflight: InflightPolicy = InflightPolicy.DRAIN  # DRAIN or ABORT only
    drain_timeout: float | None = None  # seconds; None = no bound


@dataclass(frozen=True)
class Wake:
    """Reallocate what Sleep freed (the same number of KV pages); after level 2, reload the
    served weights from where they came from (WeightsOrigin), unless an update that set every
    tensor has already restored them. A Wake while awake does nothing."""

    sleep_id: str


@dataclass(frozen=True)
class SleepOutcome:
    """The one answer to a Sleep or a Wake (same `sleep_id`)."""

    sleep_id: str
    level: int  # the sleep level now: 0 awake, 1 or 2 asleep
    error_code: ErrorCode | None = None  # None when done; else nothing changed
    message: str = ""
    aborted: int = 0  # sequences ended ABORTED (Sleep with ABORT)
    released_bytes: int = 0  # Sleep: bytes freed (KV, and the weights at level 2)
    reloaded: bool = False  # Wake: the weights were read again from their origin
    policy_version: int = 0  # the served version (a sleep or wake never changes it)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_code is None


# ---- LoRA adapters (engine/lora/): service -> engine LoadAdapter, UnloadAdapter, ListAdapters;
# engine -> service one AdapterOutcome for each ----


@dataclass(frozen=True)
class AdapterState:
    """One loaded adapter, as the engine holds it now."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # short names: q_proj, ..., down_proj
    pinned: bool
    resident: bool  # holds a slot now
    policy_version: int = 1  # the version its requests' tokens report


@dataclass(frozen=True)
class LoadAdapter:
    """Load the PEFT adapter directory `path` under `name` (LLMEngine.load_adapter), or with
    `replace` update the loaded `name` in place (engine/lora/adapter_update.py: `inflight` says
    what its running requests do; `pinned` is then ignored)."""

    action_id: str
    name: str
    path: str
    pinned: bool = False
    replace: bool = False
    policy_version: int = 0  # the adapter's version after it; 0: 1 (a load), current + 1
    inflight: InflightPolicy = InflightPolicy.DRAIN


@dataclass(frozen=True)
class UnloadAdapter:
    """Forget the adapter `name` (LLMEngine.unload_adapter)."""

    action_id: str
    name: str


@dataclass(frozen=True)
class ListAdapters:
    """Asks for the loaded adapters (an AdapterOutcome that changes nothing)."""

    action_id: str


@dataclass(frozen=True)
class AdapterOutcome:
    """The one answer to a LoadAdapter, UnloadAdapter or ListAdapters (same `action_id`):
    `adapters` loaded after it, in load order; `error_code` and `message` when it failed, and
    then nothing changed. INVALID_ARGUMENT: the adapter does not fit the model or the engine;
    ALREADY_EXISTS: the name is loaded; NOT_FOUND: it is not; FAILED_PRECONDITION: max_loras is
    0, pinning would pin every slot, requests run it, or a replace's version does not exceed the
    adapter's; OUT_OF_RANGE: the version is too big."""

    action_id: str
    adapters: tuple[AdapterState, ...] = ()
    error_code: ErrorCode | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.error_code is None
