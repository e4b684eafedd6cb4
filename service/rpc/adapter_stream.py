"""Admin LoadAdapterStream: a LoRA adapter streamed as UpdateWeights streams inline tensors.

In order: the header (the first message, INVALID_ARGUMENT naming `header` otherwise); its
LoadAdapterRequest checked as LoadAdapter checks one (service/rpc/adapters.py; fields named
`header.request.*`, `path` must be empty) and its adapter_config (at most MAX_CONFIG_BYTES,
checked as a directory's config is, engine/protocol/validation/adapter_config.py: `header.adapter_config`);
then every TensorChunk spooled into a private PEFT directory
(service/engine_link/adapter_spool.py: UpdateWeights' chunk rules and `tensor.*` fields, at
most MAX_ADAPTER_BYTES in at most MAX_ADAPTER_TENSORS tensors, refused before more is written;
the writes run on the adapters' own thread pool); then the same
LoadAdapter message as a directory load, naming the spool. The engine's INVALID_ARGUMENT names
`tensor` when its message is about a tensor or a target module, else `header.adapter_config`.

The spool is deleted here on any refusal before the load is sent; once sent, the engine
client's AdapterLink owns it (deleted if the load fails, kept for the replay while it serves).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
from sluice.v1 import admin_pb2 as pb

from engine.protocol.validation.adapter_config import MAX_CONFIG_BYTES, check_config, parse_config
from service.config import ServiceConfig
from service.engine_link.adapter_spool import AdapterSpool
from service.engine_link.engine_client import EngineClient
from service.engine_link.tensor_file import NO_ROOM, ChunkError
from service.rpc.adapters import check_load, send_load
from service.rpc.refusal import Refusal


async def load_adapter_stream(
    engine: EngineClient,
    config: ServiceConfig,
    messages: AsyncIterator[pb.LoadAdapterStreamRequest],
    draining: bool,
) -> pb.LoadAdapterResponse:
    """Spool the streamed adapter and load it; its AdapterInfo, or Refusal."""
    header = _validated_header(await anext(messages, None), config.engine.max_lora_rank)
    check_load(engine, header.request, draining, path_field="header.request.path")
    try:
        spool = AdapterSpool(config.weights_dir, header.adapter_config, engine.adapters.files)
    except OSError as exc:
        raise _no_room(exc) from exc
    try:
        await _receive(spool, messages)
    except OSError as exc:
        spool.delete()
        raise _no_room(exc) from exc
    except BaseException:
        spool.delete()
        raise
    # From here AdapterLink owns the spool (send_load hands it over with the load).
    return await send_load(engine, header.request, spool.path, _content_field)


def _validated_header(
    first: pb.LoadAdapterStreamRequest | None, max_rank: int
) -> pb.LoadAdapterStreamHeader:
    if first is None or first.WhichOneof("part") != "header":
        _invalid("header", "the first message must be the header")
    text = first.header.adapter_config
    if not text:
        _invalid("header.adapter_config", "must not be empty (the adapter_config.json text)")
    if len(text.encode()) > MAX_CONFIG_BYTES:
        _invalid("header.adapter_config", f"must be at most {MAX_CONFIG_BYTES} bytes")
    try:
        check_config(parse_config(text), max_rank)
    except ValueError as exc:
        _invalid("header.adapter_config", str(exc))
    return first.header


async def _receive(
    spool: AdapterSpool, messages: AsyncIterator[pb.LoadAdapterStreamRequest]
) -> None:
    """Every TensorChunk until the caller closes its side, then the PEFT directory written."""
    try:
        async for message in messages:
            if message.WhichOneof("part") != "tensor":
                _invalid("header", "only the first message may be a header; then TensorChunks")
            chunk = message.tensor
            await spool.add(chunk.name, chunk.dtype, list(chunk.shape), chunk.offset, chunk.data)
        await spool.finish()
    except ChunkError as exc:
        _invalid(exc.field, exc.message)


def _content_field(message: str) -> str:
    """The field the engine's refusal of the spooled adapter blames (engine/lora/adapter_file.py
    words a tensor's or a target module's misfit so; the rest is the config's)."""
    return (
        "tensor" if message.startswith(("tensor ", "target module ")) else "header.adapter_config"
    )


def _no_room(exc: OSError) -> Refusal:
    code = (
        grpc.StatusCode.RESOURCE_EXHAUSTED if exc.errno in NO_ROOM else grpc.StatusCode.UNAVAILABLE
    )
    return Refusal(code, f"cannot spool the adapter in --weights-dir: {exc}")


def _invalid(field_name: str, description: str) -> NoReturn:
    raise Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid adapter: {field_name}: {description}",
        [(field_name, description)],
    )
