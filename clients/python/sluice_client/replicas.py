"""One weight update pushed to several replicas at once, each on its own address.

Admin calls go to every replica directly, never through a load balancer (which would send each
to just one replica of its choice). Each replica applies the update atomically on its own: one
that fails keeps its old weights and version while the others move on, and the caller sees
which did what.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from sluice.v1 import admin_pb2 as admin_pb

from sluice_client.channels import TlsConfig
from sluice_client.sync import Client
from sluice_client.weights import DEFAULT_CHUNK_BYTES, Tensors

# (target, event): called from the update's worker threads, one per target.
OnReplicaProgress = Callable[[str, admin_pb.UpdateWeightsProgress], None]


@dataclass(frozen=True)
class ReplicaUpdate:
    """How the update ended on one replica: `applied` when it succeeded; else `code` (a
    grpc.StatusCode name) and `message` say why, and that replica serves what it served before."""

    target: str
    applied: admin_pb.Applied | None
    code: str = "OK"
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.applied is not None


def update_all(
    targets: Sequence[str],
    *,
    checkpoint_dir: str | None = None,
    tensors: Tensors | None = None,
    admin_token: str | None = None,
    api_token: str | None = None,
    tls: TlsConfig | None = None,
    policy_version: int = 0,
    inflight: str = "drain",
    drain_timeout_ms: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_progress: OnReplicaProgress | None = None,
    timeout: float | None = None,
) -> list[ReplicaUpdate]:
    """Update every replica in `targets` (their own addresses) in parallel, to one version.

    The source is `checkpoint_dir` (a directory on every replica's file system) or `tensors`
    (as for `Client.update_weights_inline`; the same bytes are streamed to each replica).
    `policy_version` 0 means one above the newest version any replica serves (read with
    GetServerInfo, which needs `api_token` when the replicas require one), so that every
    replica ends on the same version; a replica whose version cannot be read is reported
    failed and not updated. Returns one ReplicaUpdate per target, in order; never raises for
    a replica's failure (grpc errors are in the results), only for bad arguments.
    """
    if not targets:
        raise ValueError("update_all: give at least one target")
    if len(set(targets)) != len(targets):
        raise ValueError("update_all: a target is listed twice")
    if (checkpoint_dir is None) == (tensors is None):
        raise ValueError("update_all: give exactly one source: checkpoint_dir or tensors")
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        unreachable: dict[str, ReplicaUpdate] = {}
        if policy_version == 0:
            served = list(pool.map(lambda t: _served_version(t, api_token, tls), targets))
            unreachable = {r.target: r for r in served if isinstance(r, ReplicaUpdate)}
            versions = [v for v in served if isinstance(v, int)]
            if not versions:
                return [unreachable[t] for t in targets]
            policy_version = max(versions) + 1
        options: dict[str, Any] = {
            "policy_version": policy_version,
            "inflight": inflight,
            "drain_timeout_ms": drain_timeout_ms,
            "timeout": timeout,
        }

        def update(target: str) -> ReplicaUpdate:
            if target in unreachable:
                return unreachable[target]
            progress = None if on_progress is None else _for_target(on_progress, target)
            try:
                with Client(target, admin_token=admin_token, tls=tls) as client:
                    if checkpoint_dir is not None:
                        applied = client.update_weights(
                            checkpoint_dir, on_progress=progress, **options
                        )
                    else:
                        assert tensors is not None
                        applied = client.update_weights_inline(
                            tensors, chunk_bytes=chunk_bytes, on_progress=progress, **options
                        )
            except grpc.RpcError as exc:
                return ReplicaUpdate(target, None, exc.code().name, exc.details() or "")
            except RuntimeError as exc:  # the call ended OK without an `applied` event
                return ReplicaUpdate(target, None, "UNKNOWN", str(exc))
            return ReplicaUpdate(target, applied)

        return list(pool.map(update, targets))


def _served_version(
    target: str, api_token: str | None, tls: TlsConfig | None
) -> int | ReplicaUpdate:
    """The replica's policy version, or its failure as a ReplicaUpdate."""
    try:
        with Client(target, api_token=api_token, tls=tls, retry=False) as client:
            return int(client.info().policy_version)
    except grpc.RpcError as exc:
        message = f"reading its policy version: {exc.details() or ''}"
        return ReplicaUpdate(target, None, exc.code().name, message)


def _for_target(
    on_progress: OnReplicaProgress, target: str
) -> Callable[[admin_pb.UpdateWeightsProgress], None]:
    return lambda event: on_progress(target, event)
