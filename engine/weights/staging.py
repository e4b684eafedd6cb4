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
from engine.weights.in_format import InFormatTensors

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
    host. `kept`: the model's in-format tensors (in_format.py), which take quantized data with
    its scales (named as the served checkpoint names them) or full-precision tensors in the
    served dtype, quantized to the model's format."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        sharding: ShardLayout | None,
        kept: InFormatTensors | None = None,
    ) -> None:
        self.params = params
        self.sharding = sharding or ShardLayout()
        self.kept = kept or InFormatTensors({})
        self.tensors: dict[str, torch.Tensor] = {}
        self.shares: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # in-format: data, scales
        # An in-format tensor's quantized data (0) or scales (1), whole, awaiting the other.
        self._halves: dict[tuple[str, int], torch.Tensor] = {}

    def add(self, name: str, source: Any, shape: tuple[int, ...], cast: bool) -> None:
        """Stage this rank's slice of whole tensor `source` (a tensor or a safetensors slice)
        of shape `shape`."""
        half = self.kept.part(name, source.dtype)
        if half is not None:
            self._halves[half] = source[:]  # checked with the other half in `finish`
            return
        param = check_tensor(self.params, self.sharding, name, shape)
        served = self.kept.served(name, param)
        slot = self.kept.slots.get(name)
        if not cast and source.dtype != served:
            raise invalid(f"{name}: dtype {source.dtype} != served dtype {served}")
        if slot is not None:
            self.put(name, slot.quantize(source[:], self.sharding.split(name)))
        else:
            self.tensors[name] = self.sharding.take(name, source).to(param.dtype)

    def put(self, name: str, share: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Stage an in-format tensor's share (its slot's data and scales)."""
        self.shares[name] = (share[0].clone(), share[1].clone())  # not views of a whole one

    def own(self, name: str) -> None:
        """Make a staged slice own its memory (its source is a buffer about to go)."""
        if name in self.tensors:
            self.tensors[name] = self.tensors[name].clone()
        for half in [h for h in self._halves if self.kept.slots[h[0]].parts(h[0])[h[1]] == name]:
            self._halves[half] = self._halves[half].clone()

    def finish(self) -> None:
        """Pair each in-format tensor's e4m3 data with its scales; WeightUpdateError names a
        half without the other or scales that do not fit."""
        for name in dict.fromkeys(name for name, _ in self._halves):
            slot = self.kept.slots[name]
            data_name, scale_name = slot.parts(name)
            data, scales = self._halves.pop((name, 0), None), self._halves.pop((name, 1), None)
            if data is None:
                raise invalid(f"{scale_name} without its {data_name}")
            if scales is None:
                raise invalid(f"{data_name}: quantized data without its {scale_name}")
            try:
                self.put(name, slot.share(data, scales, self.sharding.split(name)))
            except ValueError as exc:
                raise invalid(f"{data_name} / {scale_name}: {exc}") from exc

    def apply(self) -> None:
        with torch.no_grad():
            for name, tensor in self.tensors.items():
                self.params[name].copy_(tensor)
            for name, share in self.shares.items():
                self.kept.slots[name].write(share)

    def nbytes_of(self, name: str) -> int:
        """The bytes staged for `name` (0: none yet)."""
        parts = (self.tensors[name],) if name in self.tensors else self.shares.get(name, ())
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_of(name) for name in [*self.tensors, *self.shares])

    @property
    def count(self) -> int:
        return len(self.tensors) + len(self.shares)


def stage_checkpoint(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout | None,
    directory: str,
    progress: Progress,
    kept: InFormatTensors | None = None,
) -> StagedWeights:
    """Every parameter from an HF checkpoint directory, cast to the served dtype (a quantized
    checkpoint's tensors dequantized into it); an in-format tensor copied with its scales, or
    quantized from full precision."""
    staged = StagedWeights(params, sharding, kept)
    done = 0
    try:
        with CheckpointReader(Path(directory)) as reader:
            for name in reader.names():
                param = check_tensor(params, staged.sharding, name, reader.shape(name))
                _stage_read(staged, reader, name, param.dtype)
                done += staged.nbytes_of(name)
                progress(done, staged.count)
    except WeightUpdateError:
        raise
    except UnsupportedModelError as exc:  # a quantization Sluice does not compute
        raise invalid(f"checkpoint_dir {directory!r}: {exc}") from exc
    except Exception as exc:  # missing, corrupt, truncated or refused: the caller's input
        raise invalid(f"checkpoint_dir {directory!r} is unreadable: {exc}") from exc
    missing = sorted(set(params) - set(staged.tensors) - set(staged.shares))
    if missing:
        raise invalid(f"checkpoint_dir {directory!r} lacks tensors: {', '.join(missing[:8])}")
    return staged


def _stage_read(
    staged: StagedWeights, reader: CheckpointReader, name: str, dtype: torch.dtype
) -> None:
    slot, split = staged.kept.slots.get(name), staged.sharding.split(name)
    if slot is None:
        staged.tensors[name] = reader.read(name, staged.sharding, dtype)
    elif reader.is_quantized(name):
        staged.put(name, slot.share(*reader.read_parts(name), split))
    else:  # full precision, quantized whole (as every rank does)
        staged.put(name, slot.quantize(reader.read(name, ShardLayout(), torch.float32), split))


def stage_tensor_file(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout | None,
    path: str,
    refs: tuple[TensorRef, ...],
    progress: Progress,
    kept: InFormatTensors | None = None,
) -> StagedWeights:
    """The tensors laid out in a raw file (written by the service from inline chunks)."""
    staged = StagedWeights(params, sharding, kept)
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
                staged.own(ref.name)  # NOTE: the mmap closes below
                del flat  # release the buffer export before the mmap closes
                done += staged.nbytes_of(ref.name)  # this rank's slice
                progress(done, staged.count)
    except OSError as exc:
        raise invalid(f"tensor file {path!r} is unreadable: {exc}") from exc
    staged.finish()
    return staged


def stage_tensors(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout | None,
    tensors: Mapping[str, torch.Tensor],
    kept: InFormatTensors | None = None,
) -> StagedWeights:
    """In-memory tensors from a trainer in the same process (dtype must be the served one;
    an in-format tensor's may be its quantized data with its scales)."""
    staged = StagedWeights(params, sharding, kept)
    for name, tensor in tensors.items():
        staged.add(name, tensor.detach(), tuple(tensor.shape), cast=False)
    staged.finish()
    return staged
