"""Building UpdateWeights request streams (no grpc, no torch): the header, tensors split into
TensorChunks, and raw tensors read from a safetensors file with the standard library."""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from sluice.v1 import admin_pb2 as admin_pb

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
INFLIGHT_NAMES = ("drain", "abort", "continue", "recompute")

# name -> (safetensors dtype "F32"/"F16"/"BF16", shape, raw row-major little-endian bytes)
Tensors = Mapping[str, tuple[str, Sequence[int], bytes | bytearray | memoryview]]


def inflight_policy(name: str) -> admin_pb.InflightPolicy.ValueType:
    """'drain' | 'abort' | 'continue' | 'recompute' -> the enum value."""
    if name.lower() not in INFLIGHT_NAMES:
        raise ValueError(f"inflight: {name!r} is not one of {', '.join(INFLIGHT_NAMES)}")
    return admin_pb.InflightPolicy.Value(f"INFLIGHT_POLICY_{name.upper()}")


def build_header(
    *,
    checkpoint_dir: str | None = None,
    inline_tensors: bool = False,
    distributed: admin_pb.DistributedSource | None = None,
    policy_version: int = 0,
    inflight: str = "drain",
    drain_timeout_ms: int | None = None,
) -> admin_pb.UpdateWeightsHeader:
    """The first message of an update: exactly one of checkpoint_dir / inline_tensors /
    distributed (the tensor list a trainer then broadcasts: sluice_client.weight_transfer)."""
    if (checkpoint_dir is not None) + inline_tensors + (distributed is not None) != 1:
        raise ValueError("give exactly one source: checkpoint_dir, inline_tensors or distributed")
    header = admin_pb.UpdateWeightsHeader(
        policy_version=policy_version, inflight=inflight_policy(inflight)
    )
    if checkpoint_dir is not None:
        header.checkpoint_dir = checkpoint_dir
    elif distributed is not None:
        header.distributed.CopyFrom(distributed)
    else:
        header.inline_tensors = True
    if drain_timeout_ms is not None:
        header.drain_timeout_ms = drain_timeout_ms
    return header


def tensor_chunks(
    tensors: Tensors, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[admin_pb.UpdateWeightsRequest]:
    """Each tensor as TensorChunks of at most `chunk_bytes` bytes, in order; dtype and shape
    ride on each tensor's first chunk only. Slices are copied one chunk at a time."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes: must be >= 1")
    for name, (dtype, shape, data) in tensors.items():
        view = memoryview(data).cast("B")
        for offset in range(0, len(view), chunk_bytes):
            chunk = admin_pb.TensorChunk(
                name=name, offset=offset, data=bytes(view[offset : offset + chunk_bytes])
            )
            if offset == 0:
                chunk.dtype = dtype
                chunk.shape.extend(shape)
            yield admin_pb.UpdateWeightsRequest(tensor=chunk)


def read_safetensors(path: str | Path) -> dict[str, tuple[str, list[int], memoryview]]:
    """Every tensor of one .safetensors file as (dtype, shape, bytes), memory-mapped.

    The format: an 8-byte little-endian header length, a JSON header mapping names to
    {dtype, shape, data_offsets: [begin, end]} (offsets after the header), then the data.
    """
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mapped)
    (header_len,) = struct.unpack("<Q", view[:8])
    header = json.loads(bytes(view[8 : 8 + header_len]))
    base = 8 + header_len
    tensors: dict[str, tuple[str, list[int], memoryview]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = (entry["dtype"], list(entry["shape"]), view[base + begin : base + end])
    return tensors
