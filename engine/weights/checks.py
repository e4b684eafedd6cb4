"""Checks of a weight update's source that need no tensor data, made before anything pauses.

A bad update must fail at once: under DRAIN the engine stops admitting new requests while the
running ones finish, so a refusal found only while staging would hold every new request for
nothing. From safetensors headers, the tensor refs and in-process tensors' metadata alone:
the source exists, names only parameters of the model (a distributed list: each once), each
with its whole shape and a dtype the source may have, and (a checkpoint) every parameter. Left to staging is what needs the
data: a truncated or corrupt file. The size (this rank's bytes and tensors, in the served
dtype) is what LOADING events report as their totals. `params` is the model's
checkpoint_tensors(), by checkpoint name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models.hf_config import UnsupportedModelError
from engine.parallel.shard_layout import ShardLayout
from engine.protocol.messages import TensorSpec
from engine.weights.checkpoint_reader import CheckpointReader
from engine.weights.in_format import InFormatTensors
from engine.weights.sharded_update import UpdateSource
from engine.weights.staging import DTYPES, WeightUpdateError, check_tensor, invalid

# A checkpoint is cast to the served dtype (like at start-up): any floating-point dtype will do.
CHECKPOINT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class UpdateSize:
    bytes: int
    tensors: int
    names: tuple[str, ...] = ()  # the tensors it sets


def check_update(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout,
    source: UpdateSource,
    tensors: Mapping[str, torch.Tensor] | None,
    kept: InFormatTensors | None = None,
) -> UpdateSize:
    """Raise WeightUpdateError (INVALID_ARGUMENT, naming the tensor or the path) unless
    `source` can replace the parameters it names; else the size of what it replaces.
    `kept`: the model's in-format tensors (in_format.py), whose served dtype is the model's,
    and which in-process tensors may also give as quantized data with its scales."""
    kept = kept or InFormatTensors({})
    if tensors is not None:
        names = _check_tensors(params, sharding, tensors, kept)
    elif source.distributed is not None:
        names = _check_specs(params, sharding, source.distributed.tensors, kept)
    elif source.checkpoint_dir is not None:
        names = _check_checkpoint(params, sharding, source.checkpoint_dir)
    elif source.tensor_file is not None:
        names = _check_tensor_file(params, sharding, source, kept)
    else:
        raise invalid("the update names no source")
    size = sum(params[name].numel() * params[name].element_size() for name in names)
    return UpdateSize(size, len(names), tuple(names))


def _check_tensors(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout,
    tensors: Mapping[str, torch.Tensor],
    kept: InFormatTensors,
) -> list[str]:
    """Each in the served dtype, or an in-format tensor's quantized data beside its scales
    (whose fit staging checks)."""
    names: list[str] = []
    for name, tensor in tensors.items():
        half = kept.part(name, tensor.dtype)
        if half is not None:
            owner, index = half
            other = kept.slots[owner].parts(owner)[1 - index]
            if other not in tensors:
                raise invalid(f"{name} without its {other}")
            names += [owner] if index == 0 else []
            continue
        param = check_tensor(params, sharding, name, tuple(tensor.shape))
        if tensor.dtype != (served := kept.served(name, param)):
            raise invalid(f"{name}: dtype {tensor.dtype} != served dtype {served}")
        names.append(name)
    return names


def _check_specs(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout,
    specs: tuple[TensorSpec, ...],
    kept: InFormatTensors,
) -> list[str]:
    """A distributed update's list: each tensor once, with the served shape and dtype."""
    if not specs:
        raise invalid("the distributed update lists no tensors")
    seen: set[str] = set()
    for spec in specs:
        param = check_tensor(params, sharding, spec.name, tuple(spec.shape))
        dtype = DTYPES.get(spec.dtype)
        if dtype is None:
            raise invalid(f"{spec.name}: dtype {spec.dtype!r} is not one of {sorted(DTYPES)}")
        if dtype != (served := kept.served(spec.name, param)):
            raise invalid(f"{spec.name}: dtype {spec.dtype} != served dtype {served}")
        if spec.name in seen:
            raise invalid(f"{spec.name}: listed twice")
        seen.add(spec.name)
    return [spec.name for spec in specs]


def _check_tensor_file(
    params: Mapping[str, torch.Tensor],
    sharding: ShardLayout,
    source: UpdateSource,
    kept: InFormatTensors,
) -> list[str]:
    path = source.tensor_file
    assert path is not None
    try:
        file_size = os.stat(path).st_size
    except OSError as exc:
        raise invalid(f"tensor file {path!r} is unreadable: {exc}") from exc
    for ref in source.refs:
        param = check_tensor(params, sharding, ref.name, tuple(ref.shape))
        dtype = DTYPES.get(ref.dtype)
        if dtype is None:
            raise invalid(f"{ref.name}: dtype {ref.dtype!r} is not one of {sorted(DTYPES)}")
        if dtype != (served := kept.served(ref.name, param)):
            raise invalid(f"{ref.name}: dtype {ref.dtype} != served dtype {served}")
        if (
            ref.nbytes != math.prod(ref.shape) * dtype.itemsize
            or ref.offset + ref.nbytes > file_size
        ):
            raise invalid(f"{ref.name}: {ref.nbytes} bytes do not hold shape {ref.shape}")
    return [ref.name for ref in source.refs]


def _check_checkpoint(
    params: Mapping[str, torch.Tensor], sharding: ShardLayout, directory: str
) -> list[str]:
    """From the headers: a quantized checkpoint's tensors by the model's names and shapes
    (checkpoint_reader.py), its quantization one Sluice computes."""
    seen: set[str] = set()
    try:
        with CheckpointReader(Path(directory)) as reader:
            for name in reader.names():
                where = f"{reader.file(name)}: "
                check_tensor(params, sharding, name, reader.shape(name), where=where)
                dtype = reader.dtype(name)
                if not reader.is_quantized(name) and dtype not in CHECKPOINT_DTYPES:
                    raise invalid(
                        f"{where}{name}: dtype {dtype} is not a floating-point dtype "
                        f"({', '.join(CHECKPOINT_DTYPES)})"
                    )
                seen.add(name)
    except WeightUpdateError:
        raise
    except UnsupportedModelError as exc:  # a quantization Sluice does not compute
        raise invalid(f"checkpoint_dir {directory!r}: {exc}") from exc
    except Exception as exc:  # missing, unreadable, not safetensors or refused: the caller's input
        raise invalid(f"checkpoint_dir {directory!r} is unreadable: {exc}") from exc
    missing = sorted(set(params) - seen)
    if missing:
        raise invalid(f"checkpoint_dir {directory!r} lacks tensors: {', '.join(missing[:8])}")
    return list(params)
