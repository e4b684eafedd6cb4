"""Python client for Sluice's gRPC Generation service (no torch needed).

from sluice_client import Client
with Client("127.0.0.1:50051") as client:
    for event in client.generate("Once upon a time", max_tokens=32):
        print(event.tokens.text, end="", flush=True)
"""

from __future__ import annotations

from sluice.v1 import admin_pb2 as admin_pb
from sluice.v1 import generation_pb2 as pb

from sluice_client.aio import AsyncClient, AsyncGenerateStream
from sluice_client.requests import Collector, Completion, build_request
from sluice_client.retry import DEFAULT_SERVICE_CONFIG
from sluice_client.sync import Client, GenerateStream
from sluice_client.weights import build_header, read_safetensors, tensor_chunks

__all__ = [
    "AsyncClient",
    "AsyncGenerateStream",
    "Client",
    "Collector",
    "Completion",
    "DEFAULT_SERVICE_CONFIG",
    "GenerateStream",
    "admin_pb",
    "build_header",
    "build_request",
    "pb",
    "read_safetensors",
    "tensor_chunks",
]
