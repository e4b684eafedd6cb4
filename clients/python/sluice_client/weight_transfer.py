"""WeightTransfer: a trainer pushes its tensors to a Sluice server over torch.distributed.

    from sluice_client.weight_transfer import WeightTransfer

    with WeightTransfer("server:50051", admin_token="...", host="trainer-host") as transfer:
        for step in range(steps):
            train(model)
            transfer.push(dict(model.state_dict()), policy_version=step + 1)

gRPC carries control only: entering hosts the group's TCPStore here (this process is its rank
0) and calls Admin.InitWeightTransfer while joining, since a group forms only when every rank
joins; `push` sends an UpdateWeights header listing the tensors (name, dtype, shape), waits
for the server's `paused`, broadcasts them packed into buckets of at most `bucket_bytes`, and
returns the `applied` event. Leaving tells the server to leave the group (InitWeightTransfer
with `close`) and tears the group down here.

Failures: a refused update (a bad tensor list, a version not above the served one) raises
grpc.RpcError before any byte moves, and the group stays usable. A transfer that fails once
bytes move (the server's engine died, a broadcast timed out) raises too, and the group is
gone on both sides: make a new WeightTransfer. torch is imported only when one is entered.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import grpc
from sluice.v1 import admin_pb2 as admin_pb

from sluice_client.sync import Client, OnProgress
from sluice_client.trainer_group import TrainerGroup, dtype_name
from sluice_client.weights import build_header

DEFAULT_BUCKET_BYTES = 1 << 30


class WeightTransfer:
    """`host`: the address the server reaches this process at (the store listens on `port`; 0
    picks a free one). `engine_ranks`: the server's tensor-parallel ranks, asked of it
    (GetServerInfo's tensor_parallel_size) when None; they join as ranks `rank_offset`.. of a
    group of rank_offset + engine_ranks. `timeout` (seconds): the join and
    each broadcast wait at most this for the other ranks (at most the server's
    --stall-timeout). `client`: a Client to use instead of one made from `target`."""

    def __init__(
        self,
        target: str,
        *,
        admin_token: str | None = None,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        port: int = 0,
        group_name: str = "sluice-weights",
        timeout: float = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        engine_ranks: int | None = None,
        rank_offset: int = 1,
        client: Client | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError("bucket_bytes: must be >= 1")
        self.target = target
        self.backend = backend
        self.host, self.port = host, port
        self.group_name = group_name
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        if engine_ranks is not None and engine_ranks < 1:
            raise ValueError("engine_ranks: must be >= 1")
        self.engine_ranks = engine_ranks
        self.rank_offset = rank_offset
        self._own_client = client is None
        self.client = client or Client(target, admin_token=admin_token)
        self._group: TrainerGroup | None = None

    @property
    def world_size(self) -> int:
        """The group's ranks: this process's rank_offset, then the engine's."""
        return self.rank_offset + (self.engine_ranks or 1)

    def __enter__(self) -> WeightTransfer:
        if self.engine_ranks is None:  # a server before tensor_parallel_size reports 0: one
            try:
                self.engine_ranks = self.client.info().tensor_parallel_size or 1
            except BaseException:
                self._close_client()
                raise
        group = TrainerGroup(
            host=self.host,
            port=self.port,
            world_size=self.world_size,
            group_name=self.group_name,
            timeout=self.timeout,
            backend=self.backend,
        )
        joined: list[BaseException | None] = []

        def join() -> None:
            try:
                group.join()
                joined.append(None)
            except RuntimeError as exc:  # nobody joined in time: the RPC says why
                joined.append(exc)

        # The group forms only once every rank joins: this process joins in a thread while the
        # RPC has the server's ranks join.
        thread = threading.Thread(target=join, name="sluice-weight-transfer-join", daemon=True)
        thread.start()
        request = admin_pb.InitWeightTransferRequest(
            master_address=self.host,
            master_port=group.port,
            world_size=self.world_size,
            rank_offset=self.rank_offset,
            backend=self.backend,
            group_name=self.group_name,
            timeout_ms=round(self.timeout * 1000),
        )
        try:
            self.client.init_weight_transfer(request, timeout=self.timeout * 2)
        except BaseException:
            group.close()  # the join thread fails on its own within the timeout
            self._close_client()
            raise
        thread.join(self.timeout)
        if not joined or joined[0] is not None:
            group.close()
            self._close_client()
            raise RuntimeError(f"the trainer could not join the group: {joined or 'timed out'}")
        self._group = group
        return self

    def push(
        self,
        tensors: Mapping[str, Any],
        policy_version: int = 0,
        *,
        inflight: str = "drain",
        drain_timeout_ms: int | None = None,
        on_progress: OnProgress | None = None,
        timeout: float | None = None,
    ) -> admin_pb.Applied:
        """Swap in `tensors` ({HF name: torch tensor}, dtype the served one's; any subset of the
        model's) under `policy_version` (0: the served + 1). Returns the Applied event once the
        new version is live; raises grpc.RpcError with the server's status if the update is
        refused or fails, RuntimeError if the broadcast fails (the group is gone then)."""
        group = self._group
        if group is None:
            raise RuntimeError("no weight-transfer group: enter a (new) WeightTransfer")
        values = list(tensors.values())
        source = admin_pb.DistributedSource(bucket_bytes=self.bucket_bytes)
        for name, tensor in tensors.items():
            source.tensors.add(name=name, dtype=dtype_name(tensor), shape=list(tensor.shape))
        header = build_header(
            distributed=source,
            policy_version=policy_version,
            inflight=inflight,
            drain_timeout_ms=drain_timeout_ms,
        )
        call = self.client.admin_stub.UpdateWeights(
            iter([admin_pb.UpdateWeightsRequest(header=header)]),
            metadata=self.client.admin_metadata,
            timeout=timeout,
        )
        applied = None
        moved = False
        try:
            for event in call:
                if on_progress is not None:
                    on_progress(event)
                if event.HasField("paused") and not moved:
                    moved = True  # from here on a failure leaves the group on the server
                    group.broadcast(values, self.bucket_bytes)
                if event.HasField("applied"):
                    applied = event.applied
        except (grpc.RpcError, RuntimeError):
            call.cancel()
            if moved:
                self._drop_group()
            raise
        if applied is None:
            raise RuntimeError("UpdateWeights ended without an applied event")
        return applied

    def __exit__(self, *exc: object) -> None:
        """Tell the server to leave the group (best effort), then tear it down here."""
        if self._group is not None:
            with contextlib.suppress(grpc.RpcError):
                self.client.init_weight_transfer(
                    admin_pb.InitWeightTransferRequest(close=True), timeout=self.timeout
                )
            self._drop_group()
        self._close_client()

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def _close_client(self) -> None:
        if self._own_client:
            self.client.close()
