"""An adapter updated in place under a new policy version, and what its requests do then.

`replace_adapter` reads and checks the new adapter before anything changes (one that does not
fit, or a version that does not exceed the adapter's, changes nothing), then loads it under a
new key (engine/lora/registry.py) and applies `inflight` to the requests that hold the old key
(admitted, running or waiting):
- DRAIN: they finish on the old weights (the old key stays resident for them, retired, and its
  tokens report the old version); requests admitted after the replace run the new version. The
  replace does not wait for them: the two versions share the engine meanwhile (each its slot;
  with every slot busy the new version's requests wait in the queue, never fail).
- ABORT: they end ABORTED (partial output returned); the new weights take the old slot.
- CONTINUE: they move to the new key and keep their KV; their later tokens report the new
  version. Their KV mixes versions, so it is never published to the prefix cache.
- RECOMPUTE: as CONTINUE, and the running ones are preempted: their KV is computed again under
  the new weights before they go on.
Requests of other adapters and of the base model are never disturbed; the base model's policy
version does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from engine.lora.registry import AdapterRegistry, LoadedAdapter
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import MAX_POLICY_VERSION, FinishReason, InflightPolicy
from engine.scheduling.request import Request
from engine.scheduling.scheduler import Scheduler

# Ends requests with a reason and a message (the engine's RequestTable.abort).
Abort = Callable[[Sequence[str], FinishReason, str], int]


class AdapterUpdateError(ValueError):
    """A refused replace, with its gRPC status code name; nothing changed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def replace_adapter(
    registry: AdapterRegistry,
    scheduler: Scheduler,
    abort: Abort,
    seqs: list[Request],
    name: str,
    path: str | Path,
    policy_version: int = 0,
    inflight: InflightPolicy = InflightPolicy.DRAIN,
) -> LoadedAdapter:
    """Update the loaded adapter `name` from `path` to `policy_version` (0: its version + 1),
    applying `inflight` to the sequences in `seqs` that hold it. AdapterUpdateError
    (NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE) or ValueError (the adapter does not fit)
    with nothing changed. The caller holds the engine's lock with nothing in flight
    (LLMEngine.replace_adapter)."""
    registry.sweep({s.adapter_key for s in seqs if not s.is_finished})
    current = registry.loaded.get(name)
    if current is None:
        raise AdapterUpdateError(ErrorCode.NOT_FOUND, f"adapter {name!r}: not loaded")
    version = policy_version or current.version + 1
    if version > MAX_POLICY_VERSION:
        raise AdapterUpdateError(
            ErrorCode.OUT_OF_RANGE, f"policy_version {version} exceeds {MAX_POLICY_VERSION}"
        )
    if version <= current.version:
        raise AdapterUpdateError(
            ErrorCode.FAILED_PRECONDITION,
            f"policy_version {version} must exceed the version of adapter {name!r}, "
            f"{current.version}",
        )
    old, new = registry.replace(name, path, version)
    holders = [r for r in seqs if r.adapter_key == old.key and not r.is_finished]
    match inflight:
        case InflightPolicy.DRAIN:
            running = {r.adapter_key for r in scheduler.running}
            registry.make_resident(new.key, running)
        case InflightPolicy.ABORT:
            ids = list(dict.fromkeys(r.request_id for r in holders))
            why = f"aborted by an update of adapter {name!r} to policy version {version}"
            abort(ids, FinishReason.ABORTED, why)
            registry.hand_over(old.key, new.key)
        case InflightPolicy.CONTINUE | InflightPolicy.RECOMPUTE:
            for req in holders:
                req.adapter_key, req.adapter_version = new.key, new.version
                req.publish_pages = False  # NOTE: its KV (and a fork's) mixes versions
            registry.hand_over(old.key, new.key)
            if inflight is InflightPolicy.RECOMPUTE:
                for req in [r for r in scheduler.running if r.adapter_key == new.key]:
                    scheduler.preempt(req)
    return new
