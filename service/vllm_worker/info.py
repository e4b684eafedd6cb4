"""The worker protocol's descriptions of the model, the server and its load.

GetModelInfo comes from the engine's ModelInfo and the checkpoint's config.json (its
architectures, model_type and bos/pad ids, read once); GetServerInfo and GetLoads from the
engine's state and stats (EngineClient.refresh_stats), with page counts turned into tokens.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from sluice.v1 import generation_pb2 as pb

from engine.protocol.messages import EngineStats, ModelInfo
from service.config import ServiceConfig
from service.vllm_worker.pb import vllm_engine_pb2 as vpb

SERVER_TYPE = "sluice"


def _version() -> str:
    try:
        return metadata.version("sluice")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def read_config(directory: str) -> dict[str, Any]:
    """The checkpoint's config.json; empty when it has none (the demo model)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return config if isinstance(config, dict) else {}


def model_info(
    info: ModelInfo, checkpoint: dict[str, Any], served_model_name: str | None
) -> vpb.GetModelInfoResponse:
    """`checkpoint`: the model's config.json. Prompts must leave room for one token: the
    longest is max_model_len - 1 tokens."""
    return vpb.GetModelInfoResponse(
        model_path=info.path,
        is_generation=True,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=served_model_name or info.model,
        tokenizer_path=info.path,
        model_type=str(checkpoint.get("model_type", "")),
        architectures=[str(a) for a in checkpoint.get("architectures") or [info.architecture]],
        eos_token_ids=info.eos_token_ids,
        pad_token_id=_token_id(checkpoint.get("pad_token_id")),
        bos_token_id=_token_id(checkpoint.get("bos_token_id")),
        max_req_input_len=info.max_model_len - 1,
    )


def _token_id(value: object) -> int:
    """A config's token id; a list's first; 0 when unset, as vLLM's servicer reports it."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else 0


def server_info(
    config: ServiceConfig,
    info: ModelInfo | None,
    state: pb.ServingState.ValueType,
    active_requests: int,
    started_at: float,
    last_receive: float,
) -> vpb.GetServerInfoResponse:
    """`started_at`: time.monotonic() when the server began; `last_receive`: time.time() of
    the last Generate received (0 before any)."""
    response = vpb.GetServerInfoResponse(
        active_requests=active_requests,
        is_paused=state == pb.SERVING_STATE_SLEEPING,
        last_receive_timestamp=last_receive,
        uptime_seconds=time.monotonic() - started_at,
        server_type=SERVER_TYPE,
        data_parallel_size=1,
        max_num_seqs=config.engine.max_num_seqs,
    )
    if info is not None:
        response.block_size = info.page_size
        response.kv_cache_dtype = "auto"  # the KV cache has the weights' dtype
        response.model_dtype = f"torch.{info.dtype}"  # as vLLM names it
        response.max_num_seqs = info.max_num_seqs
    return response


def loads(stats: EngineStats, info: ModelInfo | None, max_num_seqs: int) -> vpb.GetLoadsResponse:
    """One SchedulerLoad (Sluice runs one data-parallel rank). token_usage: the share of KV
    pages requests hold (pages the prefix cache keeps unreferenced are free to take)."""
    page_size = info.page_size if info is not None else 0
    total = stats.total_pages or (info.total_pages if info is not None else 0)
    in_use = max(0, total - stats.free_pages - stats.cached_pages) if stats.total_pages else 0
    load = vpb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=stats.running,
        num_waiting_reqs=stats.waiting,
        num_total_reqs=stats.running + stats.waiting,
        num_used_tokens=in_use * page_size,
        max_total_num_tokens=total * page_size,
        token_usage=in_use / total if total else 0.0,
        cache_hit_rate=stats.prefix_hit_ratio,
        max_running_requests=info.max_num_seqs if info is not None else max_num_seqs,
    )
    return vpb.GetLoadsResponse(
        timestamp=datetime.now(UTC).isoformat(),
        version=_version(),
        dp_rank_count=1,
        loads=[load],
    )
