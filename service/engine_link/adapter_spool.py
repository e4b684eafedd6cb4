"""AdapterSpool: a LoRA adapter streamed by LoadAdapterStream, written out as a PEFT directory.

The tensors arrive as UpdateWeights' TensorChunks and are assembled by the same
TensorFileWriter (its chunk rules, bounds on their bytes and their number checked before any
is written; its writes, and the directory's, on the adapters' own thread pool, AdapterFiles,
never on the event loop nor on the pool that tokenizes); then
`finish` writes `adapter_config.json` (the caller's text) and `adapter_model.safetensors` (the
tensors, contiguous, in order of first appearance) beside it and deletes the raw file. The
engine then reads the directory as it reads any adapter's (engine/lora/adapter_file.py).

The directory is private (mkdtemp: mode 0700) and the caller's to delete (`delete`); once the
adapter loaded, AdapterLink owns it: it is read again when a restarted engine replays the load.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

from engine.protocol.messages import TensorRef
from engine.protocol.validation.adapter_config import CONFIG_FILE
from service.engine_link.adapter_files import AdapterFiles
from service.engine_link.tensor_file import TensorFileWriter

WEIGHTS_FILE = "adapter_model.safetensors"
# An adapter is megabytes (rank r adds r x (in + out) per projection); 8 GiB holds a rank-256
# adapter of every projection of a 70B model.
MAX_ADAPTER_BYTES = 2**33
# Two tensors (A, B) per targeted projection, seven projections a layer: 4096 is 292 layers,
# above every dense model's; a stream of many tiny tensors is refused at the 4097th name.
MAX_ADAPTER_TENSORS = 4096
COPY_BYTES = 16 * 1024 * 1024  # copied from the raw file in pieces of this size


class AdapterSpool:
    def __init__(self, directory: str | None, config_text: str, files: AdapterFiles) -> None:
        self.path = tempfile.mkdtemp(prefix="sluice-adapter-", dir=directory)
        self._config_text = config_text
        self._files = files
        try:
            self.writer = TensorFileWriter(
                self.path,
                max_bytes=MAX_ADAPTER_BYTES,
                max_tensors=MAX_ADAPTER_TENSORS,
                run=files.run,
            )
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
        await self._files.run(self._write_directory, refs)

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
