"""Building LoadAdapterStream request streams: a LoRA adapter sent to the server instead of read
from its disk. The header (the LoadAdapterRequest's fields and adapter_config.json's text),
then the tensors as UpdateWeights' TensorChunks (sluice_client.weights.tensor_chunks). The
tensors come as raw `(dtype, shape, bytes)`, as torch tensors (torch is imported only then),
or as the path of an adapter_model.safetensors file (read with the standard library)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sluice.v1 import admin_pb2 as admin_pb

from sluice_client.weights import (
    DEFAULT_CHUNK_BYTES,
    Tensors,
    inflight_policy,
    read_safetensors,
    tensor_chunks,
)

# A torch tensor's dtype name -> the safetensors name the server takes.
TORCH_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def adapter_chunks(
    name: str,
    config: Mapping[str, Any] | str,
    tensors: Mapping[str, Any] | str | Path,
    *,
    pinned: bool = False,
    replace: bool = False,
    policy_version: int = 0,
    inflight: str = "drain",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[admin_pb.LoadAdapterStreamRequest]:
    """The messages of a LoadAdapterStream call. `config`: adapter_config.json's content (a
    mapping, e.g. peft's `LoraConfig.to_dict()`, or its JSON text); `tensors`: peft's tensor names (as in
    adapter_model.safetensors) to torch tensors or `(dtype, shape, bytes)`, or the path of an
    adapter_model.safetensors file. The other arguments are LoadAdapter's."""
    request = admin_pb.LoadAdapterRequest(
        name=name,
        pinned=pinned,
        replace=replace,
        policy_version=policy_version,
        inflight=inflight_policy(inflight),
    )
    text = config if isinstance(config, str) else json.dumps(dict(config), default=_listed)
    header = admin_pb.LoadAdapterStreamHeader(request=request, adapter_config=text)
    yield admin_pb.LoadAdapterStreamRequest(header=header)
    raw = read_safetensors(tensors) if isinstance(tensors, str | Path) else _raw(tensors)
    for message in tensor_chunks(raw, chunk_bytes):
        yield admin_pb.LoadAdapterStreamRequest(tensor=message.tensor)


def _listed(value: object) -> list[Any]:
    """JSON for what peft's LoraConfig.to_dict() holds as a set (target_modules)."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"adapter config: {type(value).__name__} {value!r} is not JSON")


def _raw(tensors: Mapping[str, Any]) -> Tensors:
    """`(dtype, shape, bytes)` of each tensor; torch tensors converted (on the host, contiguous)."""
    return {name: t if isinstance(t, tuple) else _torch_raw(name, t) for name, t in tensors.items()}


def _torch_raw(name: str, tensor: Any) -> tuple[str, list[int], memoryview]:
    import torch  # only when torch tensors are given

    dtype = TORCH_DTYPES.get(str(tensor.dtype))
    if dtype is None:
        raise ValueError(
            f"tensor {name!r}: dtype {tensor.dtype} is not float32, float16 or bfloat16"
        )
    host = tensor.detach().to("cpu").contiguous()
    data = host.reshape(-1).view(torch.uint8).numpy()
    return dtype, list(host.shape), memoryview(data)
