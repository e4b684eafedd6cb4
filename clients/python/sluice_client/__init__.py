"""Python client for Sluice's gRPC Generation service (no torch needed).

from sluice_client import Client
with Client("127.0.0.1:50051") as client:
    for event in client.generate("Once upon a time", max_tokens=32):
        print(event.tokens.text, end="", flush=True)

The names below are imported on first use: `sluice_client.cli` must be importable without
importing grpc, so that the `sluice` command can set gRPC's log level before gRPC starts.

One flat package: of this repository only the generated stubs, never the server.
May import: sluice.v1
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.v1 import admin_pb2 as admin_pb
    from sluice.v1 import generation_pb2 as pb

    from sluice_client.affinity import AFFINITY_KEY
    from sluice_client.aio import AsyncClient, AsyncGenerateStream
    from sluice_client.channels import TlsConfig
    from sluice_client.replicas import ReplicaUpdate, update_all
    from sluice_client.requests import Collector, Completion, build_request, chat_prompt
    from sluice_client.retry import DEFAULT_SERVICE_CONFIG
    from sluice_client.structured import structured_output
    from sluice_client.sync import Client, GenerateStream
    from sluice_client.weights import build_header, read_safetensors, tensor_chunks

# name -> (module, attribute; None = the module itself)
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "AFFINITY_KEY": ("sluice_client.affinity", "AFFINITY_KEY"),
    "AsyncClient": ("sluice_client.aio", "AsyncClient"),
    "AsyncGenerateStream": ("sluice_client.aio", "AsyncGenerateStream"),
    "Client": ("sluice_client.sync", "Client"),
    "Collector": ("sluice_client.requests", "Collector"),
    "Completion": ("sluice_client.requests", "Completion"),
    "DEFAULT_SERVICE_CONFIG": ("sluice_client.retry", "DEFAULT_SERVICE_CONFIG"),
    "GenerateStream": ("sluice_client.sync", "GenerateStream"),
    "ReplicaUpdate": ("sluice_client.replicas", "ReplicaUpdate"),
    "TlsConfig": ("sluice_client.channels", "TlsConfig"),
    "admin_pb": ("sluice.v1.admin_pb2", None),
    "build_header": ("sluice_client.weights", "build_header"),
    "build_request": ("sluice_client.requests", "build_request"),
    "chat_prompt": ("sluice_client.requests", "chat_prompt"),
    "pb": ("sluice.v1.generation_pb2", None),
    "read_safetensors": ("sluice_client.weights", "read_safetensors"),
    "structured_output": ("sluice_client.structured", "structured_output"),
    "tensor_chunks": ("sluice_client.weights", "tensor_chunks"),
    "update_all": ("sluice_client.replicas", "update_all"),
}
__all__ = [
    "AFFINITY_KEY",
    "AsyncClient",
    "AsyncGenerateStream",
    "Client",
    "Collector",
    "Completion",
    "DEFAULT_SERVICE_CONFIG",
    "GenerateStream",
    "ReplicaUpdate",
    "TlsConfig",
    "admin_pb",
    "build_header",
    "build_request",
    "chat_prompt",
    "pb",
    "read_safetensors",
    "structured_output",
    "tensor_chunks",
    "update_all",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sluice_client' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # once
    return value
