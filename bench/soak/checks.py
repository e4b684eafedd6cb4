"""The soak's checks of one request's events: exactly one `started` (index 0) before any
tokens, at most one `finished` per index, nothing after an index's `finished`; and the
request's outcome once its call ended (or never did)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from google.rpc import code_pb2
from sluice_client import pb

# Protocol violations, by kind: these are "duplicated", the others "out of order".
DUPLICATES = ("duplicate_started", "duplicate_finished", "event_after_finished")


class RequestCheck:
    """The events of one request (all its n indices), checked as they arrive.

    A `refused` event (GenerateStream's answer to a start refused before admission) must be
    the only event of its request; anything else out of order is a violation.
    """

    def __init__(self, request_id: str, n: int, logprobs: bool = False) -> None:
        self.request_id = request_id
        self.n = n
        self.logprobs = logprobs
        self.started = 0
        self.token_ids: dict[int, list[int]] = {i: [] for i in range(n)}
        self.versions: dict[int, list[int]] = {i: [] for i in range(n)}  # one per chunk
        self.reasons: dict[int, str] = {}
        self.messages: dict[int, str] = {}
        self.refusal: str | None = None  # the status of a refused start ("UNAVAILABLE")
        self.violations: Counter[str] = Counter()

    @property
    def done(self) -> bool:
        """Every index finished, or the start was refused (one `refused` answers them all)."""
        return len(self.reasons) == self.n or self.refusal is not None

    def add(self, event: Any) -> None:
        index = event.index
        if event.request_id != self.request_id:
            self.violations["wrong_request_id"] += 1
        if index >= self.n:
            self.violations["index_out_of_range"] += 1
            return
        match event.WhichOneof("event"):
            case "started":
                if index != 0:
                    self.violations["started_with_index"] += 1
                if self.started:
                    self.violations["duplicate_started"] += 1
                elif any(self.token_ids.values()) or self.reasons:
                    self.violations["started_late"] += 1
                self.started += 1
            case "tokens":
                chunk = event.tokens
                if index in self.reasons:
                    self.violations["event_after_finished"] += 1
                if not self.started or self.refusal is not None:
                    self.violations["tokens_before_started"] += 1
                if self.logprobs and len(chunk.logprobs) != len(chunk.token_ids):
                    self.violations["logprobs_length"] += 1
                self.token_ids[index].extend(chunk.token_ids)
                self.versions[index].append(chunk.policy_version)
            case "finished":
                if index in self.reasons:
                    self.violations["duplicate_finished"] += 1
                    return
                reason = pb.FinishReason.Name(event.finished.reason)
                self.reasons[index] = reason.removeprefix("FINISH_REASON_")
                self.messages[index] = event.finished.message
                if not self.started:
                    self.violations["finished_before_started"] += 1
            case "refused":
                if self.started or self.reasons or self.refusal is not None:
                    self.violations["refused_after_events"] += 1
                self.refusal = code_pb2.Code.Name(event.refused.code)
            case _:
                self.violations["empty_event"] += 1


@dataclass
class Record:
    """One request as the load generator saw it."""

    request_id: str
    kind: str  # generate | stream | canary
    check: RequestCheck
    t0: float = field(default_factory=time.monotonic)
    t1: float | None = None  # when it ended: all indices finished, or the call ended
    status: str | None = None  # the call's gRPC status once it ended ("OK", "UNAVAILABLE")
    client_cancelled: bool = False
    cancel: str | None = None  # Cancel RPC / cancel_request_id sent: what it answered
    canary: int | None = None  # which canary prompt

    @property
    def outcome(self) -> str:
        check = self.check
        if check.done:
            if (code := check.refusal) is not None:
                return f"refused.{code}"
            return "+".join(sorted(set(check.reasons.values())))
        if self.client_cancelled:
            return "client_cancelled"
        if self.status is None:
            return "lost"
        if self.status != "OK":
            return f"status.{self.status}"
        return "missing_finished"  # the call ended OK before every index finished

    def end(self, status: str | None = None) -> None:
        if self.t1 is None:
            self.t1 = time.monotonic()
        if status is not None and self.status is None:
            self.status = status

    def describe(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "kind": self.kind,
            "n": self.check.n,
            "outcome": self.outcome,
            "reasons": self.check.reasons,
            "violations": dict(self.check.violations),
            "cancel": self.cancel,
            "client_cancelled": self.client_cancelled,
            "seconds": None if self.t1 is None else round(self.t1 - self.t0, 3),
        }
