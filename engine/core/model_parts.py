"""ModelParts: what LLMEngine serves from: the model, its KV pool and runner, the adapters, the
tensor-parallel workers; loaded once at start-up.

With `tensor_parallel_size` N > 1 this process is rank 0: it starts N-1 worker processes
(engine/parallel/worker_group.py), holds the scheduler, the page tables and the sampler, and its
model runner sends each step's inputs to the workers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.execution.model_shard import (
    ModelShard,
    load_shard,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from engine.layers.kernel_choice import use_triton_kernels
from engine.lora.registry import AdapterRegistry
from engine.models.base import model_class
from engine.models.hf_config import ModelConfig, load_model_config
from engine.parallel.tensor_parallel import TensorParallel
from engine.parallel.worker_group import WorkerGroup
from engine.protocol.config import EngineConfig
from engine.speculative.draft_model import DraftModel, draft_config, load_draft
from engine.structured.compile_pool import CompileLimits
from engine.structured.grammars import Grammars


@dataclass
class ModelParts:
    path: Path  # the checkpoint directory
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    shard: ModelShard  # the model, its KV pool and runner
    lora: AdapterRegistry
    workers: WorkerGroup | None  # the other ranks (None with one rank)
    draft: DraftModel | None  # --speculative-method draft: this rank's shard of the draft


def load_model_parts(config: EngineConfig, lock: threading.RLock) -> ModelParts:
    """Load the model shard of rank 0 (starting the other ranks first); `lock` is the engine's,
    which the workers' channel takes around each exchange."""
    size = config.tensor_parallel_size
    device = resolve_device(config.device, 0, size)
    dtype = resolve_dtype(config.dtype, device)
    path = resolve_model_path(config.model)
    cfg = load_model_config(path, config.max_model_len)
    workers: WorkerGroup | None = None
    tp = TensorParallel()
    draft_cfg = draft_config(config, path, cfg) if config.speculative_method == "draft" else None
    if size > 1:
        # A size that does not divide the model fails here, alone, by the family's own table.
        model_class(cfg.architecture).shard_layout(cfg, 0, size)
        from engine.tp_worker import rank_threads, worker_main

        torch.set_num_threads(rank_threads(config))
        workers = WorkerGroup(config, path, device, worker_main)
        tp = workers.tp
    shard = load_shard(config, cfg, path, tp, device, dtype)
    draft = None
    if draft_cfg is not None:  # NOTE: before the workers' channel pings them (WorkerGroup.attach)
        draft = load_draft(config, draft_cfg, tp, device, dtype, shard.pool.num_bytes)
    if workers is not None:
        workers.attach(shard.runner.open_channel(), lock)
    lora = shard.runner.adapters = AdapterRegistry(
        shard.model,
        config.max_loras,
        config.max_lora_rank,
        shard.runner,
        triton=use_triton_kernels(config.layer_kernels, device),
    )
    return ModelParts(path, cfg, device, dtype, shard, lora, workers, draft)


def grammars(config: EngineConfig, parts: ModelParts) -> Grammars:
    """The structured-output grammar compiler for the model's vocabulary."""
    cfg, whitespace = parts.model_config, config.json_whitespace
    limits = CompileLimits.of(config)
    return Grammars(
        parts.path, cfg.vocab_size, cfg.eos_token_ids, limits, json_whitespace=whitespace
    )
