"""ErrorCode: why the engine refused or failed what it was asked, on every answer that can fail.

WeightsProgress, WeightTransferJoined, SleepOutcome, AdapterOutcome and ConstraintChecked carry
one (None when it succeeded). Each member is named for the gRPC status the service answers it
with; the mapping itself is the service's, in one place (service/rpc/engine_status.py). A
StrEnum, so it pickles as its name and reads as one in logs.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # what was sent is wrong (the field named first)
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # not now: the engine's state forbids it
    OUT_OF_RANGE = "OUT_OF_RANGE"  # a policy version past MAX_POLICY_VERSION
    NOT_FOUND = "NOT_FOUND"  # an adapter that is not loaded
    ALREADY_EXISTS = "ALREADY_EXISTS"  # an adapter name already loaded
    ABORTED = "ABORTED"  # given up midway (a drain that timed out, a broken transfer)
    CANCELLED = "CANCELLED"  # every waiter left (an abandoned compile)
    UNAVAILABLE = "UNAVAILABLE"  # the engine (or a peer it needs) cannot be reached
