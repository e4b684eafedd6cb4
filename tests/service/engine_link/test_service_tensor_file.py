"""TensorFileWriter: inline TensorChunks assembled into one file laid out per TensorRef."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from service.engine_link.tensor_file import (
    ALIGNMENT,
    MAX_DIMS,
    MAX_UPDATE_BYTES,
    ChunkError,
    TensorFileWriter,
)


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def tensor_bytes(path: str, ref) -> bytes:  # type: ignore[no-untyped-def]
    with open(path, "rb") as f:
        f.seek(ref.offset)
        return f.read(ref.nbytes)


@pytest.fixture
def writer(tmp_path: Path):
    w = TensorFileWriter(str(tmp_path))
    yield w
    w.delete()


async def test_chunks_in_any_order_and_interleaved_land_in_place(writer):
    a, b = floats(*range(6)), floats(*range(10, 13))
    await writer.add("b", "F32", [3], 8, b[8:])
    await writer.add("a", "F32", [2, 3], 12, a[12:])
    await writer.add("b", "", [], 0, b[:8])
    await writer.add("a", "F32", [2, 3], 0, a[:12])
    refs = writer.finish()
    assert [(r.name, r.dtype, r.shape, r.nbytes) for r in refs] == [
        ("b", "F32", (3,), 12),
        ("a", "F32", (2, 3), 24),
    ]
    assert all(r.offset % ALIGNMENT == 0 for r in refs)
    assert tensor_bytes(writer.path, refs[0]) == b
    assert tensor_bytes(writer.path, refs[1]) == a
    assert writer.bytes_received == writer.bytes_total == 36


async def test_first_chunk_needs_a_known_dtype_and_a_shape(writer):
    with pytest.raises(ChunkError) as err:
        await writer.add("w", "F64", [2], 0, b"\0" * 16)
    assert err.value.field == "tensor.dtype"
    with pytest.raises(ChunkError) as err:
        await writer.add("w", "F16", [], 0, b"\0" * 2)
    assert err.value.field == "tensor.shape"
    with pytest.raises(ChunkError) as err:
        await writer.add("", "F16", [1], 0, b"\0" * 2)
    assert err.value.field == "tensor.name"


async def test_later_chunks_must_repeat_dtype_and_shape_unchanged(writer):
    await writer.add("w", "BF16", [4], 0, b"\0" * 4)
    with pytest.raises(ChunkError) as err:
        await writer.add("w", "F16", [], 4, b"\0" * 4)
    assert err.value.field == "tensor.dtype"
    with pytest.raises(ChunkError) as err:
        await writer.add("w", "", [2, 2], 4, b"\0" * 4)
    assert err.value.field == "tensor.shape"


async def test_overlapping_and_out_of_range_chunks_are_refused(writer):
    await writer.add("w", "F32", [4], 4, b"\0" * 8)
    with pytest.raises(ChunkError, match="sent twice"):
        await writer.add("w", "F32", [4], 8, b"\0" * 8)
    with pytest.raises(ChunkError, match="sent twice"):
        await writer.add("w", "F32", [4], 0, b"\0" * 8)
    with pytest.raises(ChunkError, match="exceed"):
        await writer.add("w", "F32", [4], 12, b"\0" * 8)
    with pytest.raises(ChunkError, match="empty"):
        await writer.add("w", "F32", [4], 0, b"")


async def test_a_tensor_too_large_for_an_update_is_refused_before_any_write(writer):
    with pytest.raises(ChunkError, match="at most") as err:
        await writer.add("w", "F32", [2**62], 2**63, b"\0" * 4)  # 2**64 bytes
    assert err.value.field == "tensor.shape"
    await writer.add("a", "F32", [MAX_UPDATE_BYTES // 8], 0, b"\0" * 4)  # half the bound
    with pytest.raises(ChunkError, match="taken") as err:
        await writer.add("b", "F32", [MAX_UPDATE_BYTES // 8 + 1], 0, b"\0" * 4)
    assert err.value.field == "tensor.shape"
    assert os.path.getsize(writer.path) <= 4 + ALIGNMENT  # nothing written past the first chunk


async def test_a_shape_of_more_than_max_dims_is_refused(writer):
    with pytest.raises(ChunkError) as err:
        await writer.add("w", "F32", [1] * (MAX_DIMS + 1), 0, b"\0" * 4)
    assert err.value.field == "tensor.shape"


async def test_a_tensor_with_a_gap_is_incomplete(writer):
    await writer.add("w", "F32", [4], 0, b"\0" * 4)
    await writer.add("w", "F32", [4], 8, b"\0" * 8)
    with pytest.raises(ChunkError, match="12 of 16 bytes"):
        writer.finish()


async def test_no_tensors_at_all_is_refused(writer):
    with pytest.raises(ChunkError) as err:
        writer.finish()
    assert err.value.field == "tensor"


def test_delete_removes_the_file(tmp_path: Path):
    writer = TensorFileWriter(str(tmp_path))
    assert os.path.exists(writer.path) and writer.path.startswith(str(tmp_path))
    writer.delete()
    writer.delete()  # idempotent
    assert list(tmp_path.iterdir()) == []
