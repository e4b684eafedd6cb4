"""AdapterSpool: a LoRA adapter streamed by LoadAdapterStream, written out as a PEFT directory.

The tensors arrive as UpdateWeights' TensorChunks and are assembled by the same
TensorFileWriter (its chunk rules, a bound on their bytes checked before any is written); then
`finish` writes `adapter_config.json` (the caller's text) and `adapter_model.safetensors` (the
tensors, contiguous, in order of first appearance) beside it and deletes the raw file. The
engine then reads the directory as it reads any adapter's (engine/lora/adapter_file.py).

The directory is private (mkdtemp: mode 0700) and the caller's to delete (`delete`); once the
adapter loaded, AdapterLink owns it: it is read again when a restarted engine replays the load.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import tempfile

from engine.messages import TensorRef
from service.engine_link.tensor_file import TensorFileWriter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# An adapter is megabytes (rank r adds r x (in + out) per projection); 8 GiB holds a rank-256
# adapter of every projection of a 70B model.
MAX_ADAPTER_BYTES = 2**33
MAX_CONFIG_BYTES = 65536
COPY_BYTES = 16 * 1024 * 1024  # copied from the raw file in pieces of this size


class AdapterSpool:
    def __init__(self, directory: str | None, config_text: str) -> None:
        self.path = tempfile.mkdtemp(prefix="sluice-adapter-", dir=directory)
        self._config_text = config_text
        try:
            self.writer = TensorFileWriter(self.path, max_bytes=MAX_ADAPTER_BYTES)
        except BaseException:
            self.delete()
            raise

    async def add(self, name: str, dtype: str, shape: list[int], offset: int, data: bytes) -> None:
        """One TensorChunk: TensorFileWriter.add (ChunkError, OSError)."""
        await self.writer.add(name, dtype, shape, offset, data)

    async def finish(self) -> None:
        """Check that every tensor is complete (ChunkError) and write the PEFT directory
        (OSError if the disk cannot take it)."""
        refs = self.writer.finish()
        await asyncio.to_thread(self._write_directory, refs)

    def _write_directory(self, refs: tuple[TensorRef, ...]) -> None:
        with open(os.path.join(self.path, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(self._config_text)
        header, begin = {}, 0
        for ref in refs:
            header[ref.name] = {
                "dtype": ref.dtype,
                "shape": list(ref.shape),
                "data_offsets": [begin, begin + ref.nbytes],
            }
            begin += ref.nbytes
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors'
        with (
            open(self.writer.path, "rb") as raw,
            open(os.path.join(self.path, WEIGHTS_FILE), "wb") as out,
        ):
            out.write(struct.pack("<Q", len(encoded)) + encoded)
            for ref in refs:
                raw.seek(ref.offset)
                for left in range(ref.nbytes, 0, -COPY_BYTES):
                    out.write(raw.read(min(left, COPY_BYTES)))
        self.writer.delete()

    def delete(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
