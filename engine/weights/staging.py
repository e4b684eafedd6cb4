"""Reading and validating new weights for a live update, and swapping them in.

Everything is read and checked (names, shapes, dtypes) into staging tensors before any
parameter changes, so a failed update leaves the served weights untouched. The swap itself is
a copy into the existing parameters (same storage: CUDA graphs and views stay valid).

`params` is the model's checkpoint_tensors(): names are the checkpoint's, and a tensor of a
merged projection (k_proj, up_proj) is a view of its rows, so its swap writes those rows only.

Sources hold whole tensors; a tensor-parallel rank stages only its slice of each (read alone
from a checkpoint's files), checked against the whole tensor's shape.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from engine.models.hf_config import UnsupportedModelError
from engine.parallel.shard_layout import ShardLayout
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import TensorRef
from engine.weights.checkpoint_reader import CheckpointReader

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

Progress = Callable[[int, int], None]  # (bytes done, tensors done)


class WeightUpdateError(Exception):
    """A refused update; `code` says why (the service answers with its gRPC status)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> WeightUpdateError:
    return WeightUpdateError(ErrorCode.INVALID_ARGUMENT, message)


def check_tensor(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout,
    name: str,
    shape: tuple[int, ...],
    where: str = "",
) -> torch.Tensor:
    """The parameter `name` names, if `shape` is its whole shape; else WeightUpdateError
    (INVALID_ARGUMENT, prefixed with `where`)."""
    param = params.get(name)
    if param is None:
        raise invalid(f"{where}unknown tensor {name!r}: the model has no such parameter")
    expected = sharding.full_shape(name, tuple(param.shape))
    if tuple(shape) != expected:
        raise invalid(f"{where}{name}: shape {tuple(shape)} != model shape {expected}")
    return param


class StagedWeights:
    """New values for some of the model's parameters (this rank's slices), validated, on the
    host."""

    def __init__(self, params: Mapping[str, torch.Tensor], sharding: ShardLayout | None) -> None:
        self.params = params
        self.sharding = sharding or ShardLayout()
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, source: Any, shape: tuple[int, ...], cast: bool) -> None:
        """Stage this rank's slice of whole tensor `source` (a tensor or a safetensors slice)
        of shape `shape`."""
        param = check_tensor(self.params, self.sharding, name, shape)
        tensor = self.sharding.take(name, source)
        if not cast and tensor.dtype != param.dtype:
            raise invalid(f"{name}: dtype {tensor.dtype} != served dtype {param.dtype}")
        self.tensors[name] = tensor.to(param.dtype)

    def apply(self) -> None:
        with torch.no_grad():
            for name, tensor in self.tensors.items():
                self.params[name].copy_(tensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def stage_checkpoint(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout | None,
    directory: str,
    progress: Progress,
) -> StagedWeights:
    """Every parameter from an HF checkpoint directory, cast to the served dtype (a quantized
    checkpoint's tensors dequantized into it)."""
    staged = StagedWeights(params, sharding)
    done = 0
    try:
        with CheckpointReader(Path(directory)) as reader:
            for name in reader.names():
                param = check_tensor(params, staged.sharding, name, reader.shape(name))
                staged.tensors[name] = reader.read(name, staged.sharding, param.dtype)
                done += staged.tensors[name].numel() * staged.tensors[name].element_size()
                progress(done, len(staged.tensors))
    except WeightUpdateError:
        raise
    except UnsupportedModelError as exc:  # a quantization Sluice does not compute
        raise invalid(f"checkpoint_dir {directory!r}: {exc}") from exc
    except Exception as exc:  # missing, corrupt, truncated or refused: the caller's input
        raise invalid(f"checkpoint_dir {directory!r} is unreadable: {exc}") from exc
    missing = sorted(set(params) - set(staged.tensors))
    if missing:
        raise invalid(f"checkpoint_dir {directory!r} lacks tensors: {', '.join(missing[:8])}")
    return staged


def stage_tensor_file(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout | None,
    path: str,
    refs: tuple[TensorRef, ...],
    progress: Progress,
) -> StagedWeights:
    """The tensors laid out in a raw file (written by the service from inline chunks)."""
    staged = StagedWeights(params, sharding)
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            done = 0
            for ref in refs:
                dtype = DTYPES.get(ref.dtype)
                if dtype is None:
                    raise invalid(f"{ref.name}: dtype {ref.dtype!r} is not one of {sorted(DTYPES)}")
                numel = 1
                for dim in ref.shape:
                    numel *= dim
                if ref.nbytes != numel * dtype.itemsize or ref.offset + ref.nbytes > len(mm):
                    raise invalid(f"{ref.name}: {ref.nbytes} bytes do not hold shape {ref.shape}")
                flat = torch.frombuffer(mm, dtype=dtype, count=numel, offset=ref.offset)
                staged.add(ref.name, flat.view(ref.shape), tuple(ref.shape), cast=False)
                # NOTE: the staged slice must own its memory: the mmap closes below.
                staged.tensors[ref.name] = staged.tensors[ref.name].clone()
                del flat  # release the buffer export before the mmap closes
                done += staged.tensors[ref.name].numel() * dtype.itemsize  # this rank's slice
                progress(done, len(staged.tensors))
    except OSError as exc:
        raise invalid(f"tensor file {path!r} is unreadable: {exc}") from exc
    return staged


def stage_tensors(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout | None,
    tensors: Mapping[str, torch.Tensor],
) -> StagedWeights:
    """In-memory tensors from a trainer in the same process (dtype must be the served one)."""
    staged = StagedWeights(params, sharding)
    for name, tensor in tensors.items():
        staged.add(name, tensor.detach(), tuple(tensor.shape), cast=False)
    return staged
