"""CheckpointReader: a safetensors checkpoint directory's tensors under the model's names.

A plain tensor is read as stored (a tensor-parallel rank reads only its slice: safetensors'
`get_slice`). A quantized checkpoint (its config.json's `quantization_config`:
engine/weights/quantization.py) stores some model tensors as several (FP8 data and its scales,
MXFP4 blocks and scales): the reader names each by the model's name, with its model shape, and
reads it dequantized into the served dtype, whole, then cuts this rank's slice (a quantized
tensor's slice would cut through its scale blocks). The start-up load, a checkpoint update's
checks and staging, and a wake's reload all read through here, so each accepts the same
checkpoints.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.parallel.shard_layout import ShardLayout
from engine.weights.quantization import Quantization, read_quantization

# Present in some checkpoints, recomputed by us (rotary tables), never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{directory}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)"
    )


def checkpoint_quantization(directory: Path) -> Quantization | None:
    """The quantization the directory's config.json declares (None: none, or no config.json:
    plain tensors); UnsupportedModelError names a key Sluice cannot honour."""
    config = directory / "config.json"
    return read_quantization(json.loads(config.read_text())) if config.is_file() else None


class CheckpointReader(contextlib.ExitStack):
    """Open with `with`: every file stays open until the block ends. Construction reads only
    headers (and config.json); ValueError names a tensor the quantization does not allow."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory
        self.quantization = checkpoint_quantization(directory)
        self.files = checkpoint_files(directory)
        self._handles: dict[str, Any] = {}  # checkpoint name -> its file's safe_open handle
        self._file: dict[str, str] = {}  # checkpoint name -> its file's name
        self.groups: dict[str, tuple[str, ...]] = {}  # model name -> the names it is read from

    def __enter__(self) -> CheckpointReader:
        super().__enter__()
        dtypes: dict[str, str] = {}
        try:
            for path in self.files:
                handle = self.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    if not name.endswith(IGNORED_SUFFIXES):
                        self._handles[name], self._file[name] = handle, path.name
                        dtypes[name] = handle.get_slice(name).get_dtype()
            q = self.quantization
            self.groups = q.group(dtypes) if q is not None else {n: (n,) for n in dtypes}
        except BaseException:
            self.close()
            raise
        return self

    def names(self) -> list[str]:
        """The model tensors the checkpoint holds, by the model's names, in file order."""
        return list(self.groups)

    def file(self, name: str) -> str:
        """The name of the file model tensor `name` is (first) read from."""
        return self._file[self.groups[name][0]]

    def is_quantized(self, name: str) -> bool:
        return len(self.groups[name]) > 1

    def dtype(self, name: str) -> str:
        """The safetensors dtype of a plain tensor; a quantized one's data dtype."""
        first = self.groups[name][0]
        return str(self._handles[first].get_slice(first).get_dtype())

    def part_dtype(self, part: str) -> str:
        """The safetensors dtype of checkpoint tensor `part` (a quantized tensor's scales)."""
        return str(self._handles[part].get_slice(part).get_dtype())

    def shape(self, name: str) -> tuple[int, ...]:
        """Model tensor `name`'s whole shape, from the headers."""
        first = self.groups[name][0]
        shape = tuple(self._handles[first].get_slice(first).get_shape())
        if self.is_quantized(name):
            assert self.quantization is not None
            return self.quantization.shape(shape)
        return shape

    def read_parts(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized model tensor's data and scales, whole and as stored."""
        data, scales = (self._handles[p].get_tensor(p) for p in self.groups[name])
        return data, scales

    def read(self, name: str, sharding: ShardLayout, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slice of model tensor `name`, in `dtype`."""
        parts = self.groups[name]
        if len(parts) == 1:
            return sharding.take(name, self._handles[name].get_slice(name)).to(dtype)
        assert self.quantization is not None
        data, scales = (self._handles[p].get_tensor(p) for p in parts)
        whole = self.quantization.combine(data, scales, dtype)
        # NOTE: a slice is cloned, not kept as a view: staging would hold the whole tensor.
        return whole if sharding.split(name) is None else sharding.take(name, whole).clone()
