"""CausalLM: what the model runner, the weight loader and the LoRA slots need of a model.

A family's model (engine/models/llama.py for the Llama family) subclasses it, and the registry
(engine/models/registry.py) names the class for each architecture (`model_class` below).
Everything outside models/ holds a model through this interface: nothing there names a family,
its modules or its weight names (nano-vllm's and mini-sglang's runners likewise know a model by
its forward and its weight names only). The contract:

- built as `cls(cfg, backend, tp, triton_kernels)`, possibly on the meta device (the loader
  then calls `init_buffers` on the real device before it fills `checkpoint_tensors`);
- `forward` takes a packed batch: every sequence's new tokens concatenated into one [tokens]
  vector, with positions and attention metadata saying where each sequence's KV lives, and
  returns the final hidden states; `compute_logits` turns LM-head rows of them into logits.
  A decode step's forward must be capturable in a CUDA graph (no host syncs, no shapes that
  depend on tensor contents);
- `kv_layout` says the KV cache it reads (layers, this rank's KV heads, head size);
- `sharding` says which slice of each checkpoint tensor this rank holds, by checkpoint name
  (the family's table), and `checkpoint_tensors` names every tensor as its checkpoints do;
- `lora_targets` lists the projections an adapter may attach to; `config.moe` says whether
  the model has experts (a `routing` list then gains each MoE layer's expert ids).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache
from engine.attention.metadata import AttentionMetadata
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import LoraPass, RowParallelLinear
from engine.models.hf_config import ModelConfig
from engine.models.registry import ARCHITECTURES
from engine.parallel.shard_layout import ShardLayout
from engine.parallel.tensor_parallel import TensorParallel

# A projection an adapter attaches to: a column-parallel merged one (each part a target) or a
# row-parallel one.
LoraTarget = MergedLinear | RowParallelLinear


@dataclass(frozen=True)
class LayerKV:
    """One layer's KV: this rank's KV heads, their size, and the window the layer attends to
    (None: its whole context)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVLayout:
    """The KV cache one rank's model reads: per layer, K and V pages of this shape.

    `layers`, when given, describes each layer (a family whose layers differ: sliding windows,
    head sizes); empty, every layer is (num_kv_heads, head_dim) over its whole context.
    """

    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    layers: tuple[LayerKV, ...] = ()

    def layer(self, index: int) -> LayerKV:
        if self.layers:
            return self.layers[index]
        return LayerKV(self.num_kv_heads, self.head_dim)


class CausalLM(nn.Module, ABC):
    config: ModelConfig
    tp: TensorParallel
    sharding: ShardLayout
    backend: AttentionBackend

    @abstractmethod
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        triton_kernels: bool = False,
    ) -> None:
        """`triton_kernels`: the layers run engine/layers' (and engine/moe's) Triton kernels
        (engine/layers/kernel_choice.py says when); else their torch reference code."""
        super().__init__()

    @classmethod
    @abstractmethod
    def shard_layout(cls, cfg: ModelConfig, rank: int, size: int) -> ShardLayout:
        """Rank `rank` of `size`'s slices of `cfg`'s checkpoint tensors (the family's table);
        raises ValueError naming the config key when `size` does not divide what it splits,
        before any model or worker is built."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        meta: AttentionMetadata,
        kv_caches: list[KVCache] | None,
        lora: LoraPass | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [tokens, hidden]
        """The final hidden states. `kv_caches`: one per layer (None: attend over the new
        tokens only, no cache). `routing`, when given, gains each MoE layer's expert ids
        [tokens, top_k], in layer order."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32, the whole vocabulary on every rank."""

    @property
    @abstractmethod
    def kv_layout(self) -> KVLayout: ...

    @abstractmethod
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor by its checkpoint name -> this rank's part of it, sharing
        the parameters' storage, outside autograd: copying into one changes exactly that
        tensor of the served weights (loading and weight updates write through these)."""

    @abstractmethod
    def linear_weights(self) -> list[torch.Tensor]:
        """The weights the forward passes to engine/layers' `linear` whole (the CPU's packed
        copies are made of these at load)."""

    @abstractmethod
    def lora_targets(self) -> dict[str, LoraTarget]:
        """The projections an adapter may change, by module name (a merged projection's
        parts are its parent's projections: `...self_attn.qkv_proj` holds q_proj, k_proj,
        v_proj; a fused one, whose checkpoints keep it whole as Phi-3's do, is one target
        under its own name), in module order."""

    def dense_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for whole sequences from position 0, without a KV cache.

        For training and checks; serving goes through forward() with the paged cache.
        """
        batch, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device).repeat(batch)
        meta = AttentionMetadata.dense([seq] * batch)
        hidden = self.forward(input_ids.reshape(-1), positions, meta, None)
        return self.compute_logits(hidden).view(batch, seq, -1)

    @abstractmethod
    def init_buffers(self, device: torch.device) -> None:
        """Compute, on `device`, the tensors that are not loaded (rotary tables): after a
        build on the meta device."""


def model_class(architecture: str) -> type[CausalLM]:
    """The class that builds `architecture`'s model (the registry's row; the config reader
    refuses any other name before a model is built). Its module is imported here, on demand."""
    module, name = ARCHITECTURES[architecture]
    cls: type[CausalLM] = getattr(importlib.import_module(module), name)
    return cls
