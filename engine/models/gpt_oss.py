"""gpt-oss (`GptOssForCausalLM`) as transformers 5 computes it.

A Llama-shaped decoder (embedding, pre-norm layers, final RMSNorm, untied LM head) whose layers
differ in three ways, each built from the shared pieces:
- attention: q/k/v and o projections with biases; layers alternate between a sliding window
  (`layer_types`, `sliding_window`: 128 tokens in the released models) and full attention,
  passed to the backend as the layer's LayerAttention; every head has a learned sink
  (`self_attn.sinks`), a logit that joins each query's softmax and takes mass from the keys;
  YaRN rotary tables (engine/layers/rope.py), attention factor applied to cos and sin;
- feed-forward: every layer is a mixture of experts (engine/moe/block.py) whose router
  (`mlp.router`, with a bias) picks the top-k logits and softmaxes those k; the experts have
  biases, a clamped SwiGLU on interleaved gate/up columns (engine/moe/clamped_swiglu.py), and
  their checkpoint tensors are transformers' fused ones (`mlp.experts.gate_up_proj`, ...);
- the config: gpt-oss's keys and defaults (engine/models/gpt_oss_config.py).

Everything else (the forward over a packed batch, the LM head, `checkpoint_tensors`, LoRA
targets: the attention projections only) is the Llama family's (engine/models/llama.py), and
the sharding table adds the sinks and the fused experts to the Llama family's
(engine/models/gpt_oss_sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import LoraPass, RowParallelLinear
from engine.layers.rms_norm import RMSNorm
from engine.layers.rope import RotaryEmbedding
from engine.models.base import KVLayout, LayerKV
from engine.models.gpt_oss_sharding import GptOssSharding
from engine.models.hf_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.sharding import Sharding
from engine.moe.block import SparseMoeBlock
from engine.parallel.tensor_parallel import TensorParallel


def layer_windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), from `layer_types` (the config
    reader has filled and checked them: engine/models/gpt_oss_config.py)."""
    return tuple(
        cfg.sliding_window if kind == "sliding_attention" else None for kind in cfg.layer_types
    )


class GptOssAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, shard: Sharding, tp: TensorParallel, window: int | None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads  # this rank's
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))  # this rank's heads'
        self.layer = LayerAttention(sliding_window=window)

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        positions: torch.Tensor,  # [tokens]
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        cache: KVCache | None,
        meta: AttentionMetadata,
        lora: LoraPass | None = None,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add(self.qkv_proj, x, qkv)
        q, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(
            q, k, v, positions, rotary, cache, meta, layer=self.layer, sinks=self.sinks
        )  # [tokens, heads, head_dim]
        return self.o_proj(out.reshape(tokens, -1), lora)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Sharding, tp: TensorParallel, index: int) -> None:
        super().__init__()
        assert cfg.moe is not None, "the config reader gives every gpt-oss its MoeConfig"
        self.self_attn = GptOssAttention(cfg, shard, tp, layer_windows(cfg)[index])
        self.mlp = SparseMoeBlock(
            cfg.hidden_size, cfg.moe, shard.expert_intermediate_size, 0, None, tp, router="router"
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,  # [tokens, hidden]: the previous sublayer's output
        residual: torch.Tensor | None,  # the residual stream h is still to be added to
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        cache: KVCache | None,
        meta: AttentionMetadata,
        lora: LoraPass | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), not yet summed
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rotary, backend, cache, meta, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, routing), residual


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer

    @classmethod
    def shard_layout(cls, cfg: ModelConfig, rank: int, size: int) -> GptOssSharding:
        return GptOssSharding(cfg, rank, size)

    @property
    def kv_layout(self) -> KVLayout:
        """Every layer's KV heads and size alike; the sliding layers' windows."""
        kv_heads, head_dim = self.sharding.num_kv_heads, self.config.head_dim
        layers = tuple(LayerKV(kv_heads, head_dim, w) for w in layer_windows(self.config))
        return KVLayout(self.config.num_layers, kv_heads, head_dim, layers)
