"""TensorFileWriter: assembles inline TensorChunk messages into one temporary file for the engine.

Inline weights never cross the pipe byte by byte: the service writes each tensor's raw row-major
bytes into a file and sends the engine `UpdateWeights(tensor_file=path, tensors=(TensorRef...))`.

Chunk rules (documented in admin.proto): `name` on every chunk; `dtype` and `shape` on a tensor's
first chunk, later chunks repeat them unchanged or leave them empty; `offset` is the byte offset
into the tensor's data; chunks of one tensor may come in any order and interleave with other
tensors' chunks; together they must cover the tensor exactly once (no overlap, no gap).
Each tensor gets a region of the file when its first chunk arrives, aligned to ALIGNMENT bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import math
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.protocol.messages import TensorRef

DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
ALIGNMENT = 64  # each tensor starts on a 64-byte boundary: memory-mapped views stay aligned
# Explicit bounds keep file offsets far inside a signed 64-bit off_t (shape and offset are
# uint64 on the wire): the largest tensor of a real checkpoint is a few GiB, a whole update
# below 16 TiB; weights have few dimensions.
MAX_UPDATE_BYTES = 2**44
MAX_DIMS = 8
# The file cannot grow to hold the tensors: disk full, quota, or past the largest file the file
# system (or RLIMIT_FSIZE) allows; ext4's is 16 TiB, the most an update may declare.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ChunkError(ValueError):
    """A chunk that breaks the rules: INVALID_ARGUMENT, naming `field` of the TensorChunk."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name
        self.message = message


@dataclass
class _Tensor:
    ref: TensorRef
    starts: list[int] = field(default_factory=list)  # sorted chunk starts within the tensor
    ends: list[int] = field(default_factory=list)  # ends[i] pairs with starts[i]
    covered: int = 0

    def claim(self, start: int, end: int) -> None:
        """Record [start, end) as written; ChunkError if it overlaps an earlier chunk."""
        i = bisect.bisect_right(self.starts, start)
        if (i > 0 and self.ends[i - 1] > start) or (i < len(self.starts) and self.starts[i] < end):
            raise ChunkError(
                "tensor.offset", f"tensor {self.ref.name!r}: bytes [{start}, {end}) sent twice"
            )
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.covered += end - start


class TensorFileWriter:
    """Receives chunks (`add`), then `finish()` checks that every tensor is complete and
    returns the TensorRefs. The file is the caller's to delete (`delete`), also on errors."""

    def __init__(
        self,
        directory: str | None = None,
        max_bytes: int = MAX_UPDATE_BYTES,
        max_tensors: int | None = None,
        run: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    ) -> None:
        """`max_bytes`: the most the tensors may hold in all (their aligned regions); a tensor
        declared past it is refused on its first chunk, before any of its bytes are written.
        `max_tensors`: the most tensors (None: no bound but the bytes). `run(work, *args)`
        runs a write off the event loop (default: the default executor)."""
        self.max_bytes = max_bytes
        self.max_tensors = max_tensors
        self._run = run
        fd, self.path = tempfile.mkstemp(prefix="sluice-weights-", suffix=".bin", dir=directory)
        self._fd: int | None = fd
        self._tensors: dict[str, _Tensor] = {}
        self._end = 0  # the file's next free (aligned) byte
        self.bytes_received = 0

    async def add(self, name: str, dtype: str, shape: list[int], offset: int, data: bytes) -> None:
        """Validate one chunk and write its bytes in place (the write runs in a thread).
        ChunkError for a bad chunk; OSError (naming the tensor) if the file cannot take it."""
        tensor = self._tensors.get(name) or self._open(name, dtype, shape)
        ref = tensor.ref
        if dtype and dtype != ref.dtype:
            raise ChunkError("tensor.dtype", f"tensor {name!r}: dtype {dtype} != {ref.dtype}")
        if shape and tuple(shape) != ref.shape:
            raise ChunkError("tensor.shape", f"tensor {name!r}: shape {shape} != {list(ref.shape)}")
        if not data:
            raise ChunkError("tensor.data", f"tensor {name!r}: empty chunk")
        end = offset + len(data)
        if end > ref.nbytes:
            raise ChunkError(
                "tensor.offset",
                f"tensor {name!r}: bytes [{offset}, {end}) exceed its {ref.nbytes} bytes",
            )
        tensor.claim(offset, end)
        assert self._fd is not None, "the writer is closed"
        try:
            await self._run(_write_all, self._fd, data, ref.offset + offset)
        except OSError as exc:  # the same errno (ENOSPC, EFBIG...), naming what did not fit
            where = f"tensor {name!r}: bytes [{offset}, {end}) at file offset {ref.offset + offset}"
            raise OSError(exc.errno, f"{where}: {exc.strerror}") from exc
        self.bytes_received += len(data)

    def _open(self, name: str, dtype: str, shape: list[int]) -> _Tensor:
        if not name:
            raise ChunkError("tensor.name", "every chunk needs the tensor's name")
        if dtype not in DTYPE_SIZES:
            raise ChunkError(
                "tensor.dtype",
                f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)} "
                "(required on a tensor's first chunk)",
            )
        if not 1 <= len(shape) <= MAX_DIMS or any(d < 1 for d in shape):
            raise ChunkError(
                "tensor.shape",
                f"tensor {name!r}: shape {shape[: MAX_DIMS + 1]} must have 1 to {MAX_DIMS} "
                "dimensions, each >= 1 (required on a tensor's first chunk)",
            )
        if self.max_tensors is not None and len(self._tensors) >= self.max_tensors:
            raise ChunkError(
                "tensor.name", f"tensor {name!r}: more than {self.max_tensors} tensors"
            )
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if nbytes > self.max_bytes - self._end:
            raise ChunkError(
                "tensor.shape",
                f"tensor {name!r}: shape {shape} is {nbytes} bytes; the tensors hold at most "
                f"{self.max_bytes} bytes in all ({self._end} taken)",
            )
        ref = TensorRef(name, dtype, tuple(shape), self._end, nbytes)
        self._end += -(-nbytes // ALIGNMENT) * ALIGNMENT
        tensor = self._tensors[name] = _Tensor(ref)
        return tensor

    def finish(self) -> tuple[TensorRef, ...]:
        """Every tensor's ref, in order of first appearance; ChunkError if one is incomplete or
        none was sent. Closes the file (it stays on disk for the engine)."""
        self.close()
        if not self._tensors:
            raise ChunkError("tensor", "inline_tensors needs at least one TensorChunk")
        for tensor in self._tensors.values():
            if tensor.covered != tensor.ref.nbytes:
                raise ChunkError(
                    "tensor.data",
                    f"tensor {tensor.ref.name!r}: {tensor.covered} of {tensor.ref.nbytes} bytes "
                    "received",
                )
        return tuple(t.ref for t in self._tensors.values())

    @property
    def bytes_total(self) -> int:
        return sum(t.ref.nbytes for t in self._tensors.values())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def delete(self) -> None:
        self.close()
        delete_file(self.path)


def delete_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _write_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written
