"""Translating the weight-transfer parts of Admin requests: InitWeightTransfer's rendezvous
and an UpdateWeights header's DistributedSource, validated into the engine's messages.

Every violation is a Refusal INVALID_ARGUMENT with a google.rpc.BadRequest naming the field;
what only the engine knows (the model's tensor names, shapes and dtype) it checks itself.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
from sluice.v1 import admin_pb2 as pb

from engine.protocol.messages import DistributedTensors, TensorSpec, TransferGroupSpec
from service.config import ServiceConfig
from service.rpc.refusal import Refusal

BACKENDS = ("gloo", "nccl")
DTYPES = ("F32", "F16", "BF16")
DEFAULT_TIMEOUT_MS = 60_000
DEFAULT_BUCKET_BYTES = 1 << 30
MAX_BUCKET_BYTES = 1 << 40
MAX_DIMS = 8
# Ranks in a trainer's group: every rank joins a full mesh (a connection to every other), so
# the size is what the engine allocates and waits for; 4096 is far above any real group (a
# trainer and 511 servers of 8 ranks) and far below what would exhaust a host.
MAX_WORLD_SIZE = 4096
MAX_ADDRESS_CHARS = 253  # a DNS name's longest
MAX_GROUP_NAME_CHARS = 256


def transfer_group(
    request: pb.InitWeightTransferRequest, config: ServiceConfig
) -> TransferGroupSpec | None:
    """The group to join; None for `close`."""
    if request.close:
        return None
    engine_ranks = config.engine.tensor_parallel_size
    _check_name("master_address", request.master_address, MAX_ADDRESS_CHARS)
    if not 1 <= request.master_port <= 65535:
        invalid("master_port", f"{request.master_port} is not in [1, 65535]")
    if not 1 <= request.world_size <= MAX_WORLD_SIZE:
        invalid("world_size", f"{request.world_size} is not in [1, {MAX_WORLD_SIZE}]")
    if request.rank_offset < 1:
        invalid("rank_offset", "must be at least 1 (rank 0 is the trainer's)")
    if request.world_size < request.rank_offset + engine_ranks:
        invalid(
            "world_size",
            f"{request.world_size} is less than rank_offset {request.rank_offset} + the "
            f"engine's {engine_ranks} tensor-parallel ranks",
        )
    backend = request.backend or "gloo"
    if backend not in BACKENDS:
        invalid("backend", f"{request.backend!r:.80} is not one of {', '.join(BACKENDS)}")
    _check_name("group_name", request.group_name, MAX_GROUP_NAME_CHARS)
    most = int(config.stall_timeout * 1000)
    timeout_ms = request.timeout_ms if request.HasField("timeout_ms") else DEFAULT_TIMEOUT_MS
    if not request.HasField("timeout_ms"):
        timeout_ms = min(timeout_ms, most)
    if not 1 <= timeout_ms <= most:
        invalid("timeout_ms", f"{timeout_ms} is not in [1, {most}] (--stall-timeout)")
    return TransferGroupSpec(
        master_address=request.master_address,
        master_port=request.master_port,
        world_size=request.world_size,
        rank_offset=request.rank_offset,
        backend=backend,
        group_name=request.group_name,
        timeout=timeout_ms / 1000,
    )


def _check_name(field_name: str, value: str, most: int) -> None:
    """Not empty, at most `most` characters, printable without spaces (a host or a key)."""
    if not value:
        invalid(field_name, "must not be empty")
    if len(value) > most:
        invalid(field_name, f"{len(value)} characters; at most {most}")
    if not value.isprintable() or any(c.isspace() for c in value):
        invalid(field_name, f"{value!r}: only printable characters, no spaces")


def distributed_tensors(source: pb.DistributedSource) -> DistributedTensors:
    field = "header.distributed"
    if not source.tensors:
        invalid(f"{field}.tensors", "list at least one tensor")
    specs = []
    for i, tensor in enumerate(source.tensors):
        where = f"{field}.tensors[{i}]"
        if not tensor.name:
            invalid(f"{where}.name", "must not be empty")
        if tensor.dtype not in DTYPES:
            invalid(f"{where}.dtype", f"{tensor.dtype!r} is not one of {', '.join(DTYPES)}")
        if not 1 <= len(tensor.shape) <= MAX_DIMS or min(tensor.shape) < 1:
            invalid(f"{where}.shape", f"{list(tensor.shape)}: 1 to {MAX_DIMS} dimensions, >= 1")
        specs.append(TensorSpec(tensor.name, tensor.dtype, tuple(tensor.shape)))
    bucket_bytes = source.bucket_bytes if source.HasField("bucket_bytes") else DEFAULT_BUCKET_BYTES
    if not 1 <= bucket_bytes <= MAX_BUCKET_BYTES:
        invalid(f"{field}.bucket_bytes", f"{bucket_bytes} is not in [1, 2**40]")
    return DistributedTensors(tuple(specs), bucket_bytes)


def invalid(field_name: str, description: str) -> NoReturn:
    raise Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid request: {field_name}: {description}",
        [(field_name, description)],
    )
