"""ModelShard: one rank's model, KV pool and model runner, built the same way on every rank.

With tensor parallelism every rank runs `load_shard` in the same order (rank 0 inside
LLMEngine, the others in engine/tp_worker.py), so the collectives it makes (the KV page
count, CUDA-graph warm-ups) match rank for rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.attention import make_backend
from engine.execution.host_malloc import keep_freed_memory, mapped_allocations
from engine.execution.model_runner import ModelRunner
from engine.kv_cache.kv_groups import group_layers
from engine.kv_cache.page_pool import PagePool
from engine.layers.kernel_choice import use_triton_kernels
from engine.layers.linear import prepack
from engine.models.base import CausalLM, KVLayout
from engine.models.hf_config import ModelConfig
from engine.parallel.tensor_parallel import TensorParallel
from engine.protocol.config import EngineConfig
from engine.protocol.messages import ModelInfo
from engine.sampling.sampler_choice import make_sampler
from engine.weights.loading import build_model

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on the CPU


@dataclass
class ModelShard:
    model: CausalLM
    pool: PagePool
    runner: ModelRunner


def load_shard(
    config: EngineConfig,
    cfg: ModelConfig,
    path: Path,
    tp: TensorParallel,
    device: torch.device,
    dtype: torch.dtype,
) -> ModelShard:
    """Load this rank's weights, size its KV pool (every rank gets the smallest count any
    rank can hold: page ids are rank 0's) and build its runner, CUDA graphs captured."""
    if device.type == "cpu":
        keep_freed_memory()  # each step's buffers reused, not mapped anew (host_malloc.py)
    scale = cfg.head_dim**-0.5
    backend = make_backend(config.attention_backend, device, scale, config.page_size, dtype)
    triton_kernels = use_triton_kernels(config.layer_kernels, device)
    # What a sleep frees (weights, their packed copies, the KV pool) is mapped on its own, so
    # that freeing it unmaps it (host_malloc.py).
    with mapped_allocations(device.type):
        model = build_model(cfg, path, backend, device, dtype, tp, triton_kernels)
        for weight in model.linear_weights():
            prepack(weight)  # the CPU's packed copies, made at load, not by the first steps
        kv = model.kv_layout
        pages = kv_pages(config, cfg, kv, dtype, device)
        if tp.enabled:
            count = torch.tensor([pages], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.control)
            pages = int(count.item())
        shape = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        pool = PagePool(pages, config.page_size, *shape, dtype, device, kv.layers)
    runner = ModelRunner(
        model,
        pool,
        device,
        cfg.eos_token_ids,
        config.max_num_seqs + draft_rows(config),
        config.max_num_batched_tokens,
        make_sampler(config.sampler, device),
    )
    # NOTE: an MoE model is captured only with its grouped-GEMM kernel: the torch MoE layer
    # reads its per-expert token counts on the host (engine/moe/experts.py).
    capturable = cfg.moe is None or triton_kernels
    if device.type == "cuda" and not config.enforce_eager and capturable:
        runner.attach_graphs(capture=True, compile=config.compile)
    elif config.compile:
        runner.attach_graphs(capture=False, compile=True)
    return ModelShard(model, pool, runner)


# --speculative-method draft: the draft model's KV pool takes at most this share (1 / N) of the
# KV budget, which the target's pool leaves it (engine/speculative/draft_model.py).
DRAFT_KV_SHARE = 8


def draft_rows(config: EngineConfig) -> int:
    """The step rows speculative decoding may add: each proposal verified is a row of its own
    (engine/execution/draft_rows.py), and at most --speculative-max-batch requests propose
    (never more than run at once)."""
    if config.speculative_method == "off":
        return 0
    proposing = min(config.speculative_max_batch, config.max_num_seqs)
    return proposing * config.num_speculative_tokens


def kv_pages(
    config: EngineConfig, cfg: ModelConfig, kv: KVLayout, dtype: torch.dtype, device: torch.device
) -> int:
    """KV pages of this rank's layout: num_kv_pages, else what the byte budget holds. (With
    several KV groups a page id is one group's page, and a request takes one in each.)"""
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if kv.layers:
        per_page = PagePool.bytes_per_grouped_page(config.page_size, kv.layers, dtype)
    else:
        shape = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        per_page = PagePool.bytes_per_page(config.page_size, *shape, dtype)
    budget = config.kv_cache_memory
    if budget is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    elif budget is None:
        # Enough for every sequence at full length, within a fixed CPU budget.
        groups = group_layers(kv.layers).num_groups if kv.layers else 1  # a page in each
        full = groups * config.max_num_seqs * -(-cfg.max_model_len // config.page_size)
        budget = min(CPU_KV_CACHE_BYTES, full * per_page)
    if config.speculative_method == "draft":  # the draft's KV pool comes out of the budget
        budget -= budget // DRAFT_KV_SHARE
    pages = budget // per_page
    if pages < 1:
        raise ValueError(f"kv_cache_memory: {budget} bytes hold no {per_page}-byte page")
    return pages


def resolve_device(name: str, rank: int = 0, tp_size: int = 1) -> torch.device:
    """The device of rank `rank`: with tensor parallelism on CUDA, GPU `rank`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and tp_size > 1:
        if torch.cuda.device_count() < tp_size:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} ranks need {tp_size} GPUs, "
                f"this machine has {torch.cuda.device_count()}"
            )
        return torch.device("cuda", rank)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def resolve_model_path(model: str) -> Path:
    """A checkpoint directory; 'demo' is the demo checkpoint (trained on first use)."""
    if model == "demo":
        from engine.demo.checkpoint import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    return Path(model)


def model_info(
    config: EngineConfig,
    cfg: ModelConfig,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    total_pages: int,
) -> ModelInfo:
    """What the engine reports of the model it serves (at its configured policy version)."""
    return ModelInfo(
        model="demo" if config.model == "demo" else Path(config.model).name,
        path=str(path),
        architecture=cfg.architecture,
        max_model_len=cfg.max_model_len,
        vocab_size=cfg.vocab_size,
        eos_token_ids=list(cfg.eos_token_ids),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        page_size=config.page_size,
        total_pages=total_pages,
        policy_version=config.policy_version,
        max_num_seqs=config.max_num_seqs,
        moe_layers=len(cfg.moe.sparse_layers) if cfg.moe else 0,
        moe_top_k=cfg.moe.top_k if cfg.moe else 0,
        num_experts=cfg.moe.num_experts if cfg.moe else 0,
    )
