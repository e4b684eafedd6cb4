"""DraftModel: the draft checkpoint of `--speculative-method draft`, loaded beside the target,
and the KV pool of its own that it decodes in.

The draft is built through the target's path (engine/weights/loading.py's build_model over the
models registry, the attention backend and layer kernels the target's settings pick) on the
target's device and dtype, after the draft's vocabulary is checked against the target's
(draft_vocab.py). A draft whose layers form several KV groups (sliding windows) holds a page
in every group for each logical page, its whole context (the draft gives no pages back as its
windows move on).

Under the target's tensor parallelism every rank loads its shard of the draft, the way it loads
the target's (the family's shard layout: heads, MLP columns and vocabulary split N ways), right
after the target's own shard, so the collectives of the two loads pair up rank for rank. Rank 0
runs the draft's passes and sends each pass's inputs to the other ranks (draft_pass.py), as it
does a step's; a draft the tensor-parallel size does not divide is refused at start-up.

Its KV pool is sized by `draft_kv_budget`: enough for `--speculative-max-batch` sequences at the
draft's full context, but never more than an eighth (DRAFT_KV_SHARE) of the target's KV pool's
bytes, and on CUDA never more than half of the device memory left free once the draft's
weights are in. A target sized by a byte budget (--kv-cache-memory, or CUDA's free memory)
leaves an eighth of it to the draft (engine/execution/model_shard.py), so the two pools stay
within it; a target sized by --num-kv-pages does not. Every rank takes the smallest page count
any rank can hold (page ids are rank 0's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.attention import make_backend
from engine.execution.host_malloc import mapped_allocations
from engine.execution.model_shard import DRAFT_KV_SHARE
from engine.kv_cache.kv_groups import group_layers
from engine.kv_cache.page_pool import PagePool
from engine.layers.kernel_choice import use_triton_kernels
from engine.layers.linear import prepack
from engine.models.base import CausalLM, KVLayout, model_class
from engine.models.hf_config import ModelConfig, load_model_config
from engine.parallel.tensor_parallel import TensorParallel
from engine.protocol.config import EngineConfig
from engine.speculative.draft_vocab import check_same_vocabulary
from engine.weights.loading import build_model


@dataclass
class DraftModel:
    model: CausalLM
    pool: PagePool
    max_model_len: int  # the draft's context: its positions stay below this
    path: Path  # the checkpoint directory it was loaded from (a Wake reads it again)


def draft_config(config: EngineConfig, target_dir: Path, target_cfg: ModelConfig) -> ModelConfig:
    """The draft checkpoint's config, checked against the target and the tensor-parallel size
    before any worker starts or weight is read; ValueError naming `speculative_draft_model`
    for a draft this engine cannot use with the target."""
    assert config.speculative_draft_model is not None
    path = Path(config.speculative_draft_model)
    try:
        cfg = load_model_config(path, target_cfg.max_model_len)
        # A size that does not divide the draft fails here, by its family's own table.
        model_class(cfg.architecture).shard_layout(cfg, 0, config.tensor_parallel_size)
    except (OSError, ValueError) as error:  # no checkpoint there, or one Sluice cannot serve
        raise ValueError(f"speculative_draft_model: {error}") from error
    check_same_vocabulary(path, cfg, target_dir, target_cfg)
    return cfg


def load_draft(
    config: EngineConfig,
    cfg: ModelConfig,
    tp: TensorParallel,
    device: torch.device,
    dtype: torch.dtype,
    target_kv_bytes: int,
) -> DraftModel:
    """This rank's shard of `config.speculative_draft_model` (whose config `draft_config`
    checked) and its KV pool (see the module's docstring for the pool's size;
    `target_kv_bytes`, this rank's target pool's). Every rank calls it at the same point."""
    assert config.speculative_draft_model is not None
    path = Path(config.speculative_draft_model)
    scale = cfg.head_dim**-0.5
    backend = make_backend(config.attention_backend, device, scale, config.page_size, dtype)
    triton_kernels = use_triton_kernels(config.layer_kernels, device)
    # What a sleep frees is mapped on its own, as the target's is (engine/execution/model_shard.py).
    with mapped_allocations(device.type):
        try:
            model = build_model(cfg, path, backend, device, dtype, tp, triton_kernels)
        except (OSError, ValueError) as error:  # missing, misshapen or unexpected tensors
            raise ValueError(f"speculative_draft_model: {error}") from error
        for weight in model.linear_weights():
            prepack(weight)  # the CPU's packed copies, made at load as the target's are
    kv = model.kv_layout
    # A logical page is a page id in every KV group (sliding windows: kv_groups.py).
    groups = group_layers(kv.layers).num_groups if kv.layers else 1
    per_page = groups * _bytes_per_page(config.page_size, kv, dtype)
    budget = draft_kv_budget(config, cfg.max_model_len, per_page, target_kv_bytes, device)
    pages = groups * max(budget // per_page, 1)
    if tp.enabled:  # every rank the smallest count: page ids are rank 0's
        count = torch.tensor([pages], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.control)
        pages = int(count.item())
    shape = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
    with mapped_allocations(device.type):
        pool = PagePool(pages, config.page_size, *shape, dtype, device, kv.layers)
    return DraftModel(model, pool, cfg.max_model_len, path)


def draft_kv_budget(
    config: EngineConfig,
    max_model_len: int,
    per_page: int,
    target_kv_bytes: int,
    device: torch.device,
) -> int:
    """The draft pool's bytes: `speculative_max_batch` full-length sequences at most, within
    1 / DRAFT_KV_SHARE of the target's KV and (CUDA) half of the free device memory.
    `per_page`: the bytes of one logical page (a page id in every KV group)."""
    pages_per_seq = -(-max_model_len // config.page_size)
    budget = config.speculative_max_batch * pages_per_seq * per_page
    budget = min(budget, target_kv_bytes // DRAFT_KV_SHARE)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, free // 2)
    return budget


def _bytes_per_page(page_size: int, kv: KVLayout, dtype: torch.dtype) -> int:
    if kv.layers:
        return PagePool.bytes_per_grouped_page(page_size, kv.layers, dtype)
    return PagePool.bytes_per_page(page_size, kv.num_layers, kv.num_kv_heads, kv.head_dim, dtype)
