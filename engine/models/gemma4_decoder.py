"""Gemma 4's decoder layer and its per-layer input embeddings (PLE), as transformers 5.23's
Gemma4TextDecoderLayer and Gemma4TextModel's get_per_layer_inputs / project_per_layer_inputs
compute them.

PLE: each token has, for every layer, a small vector (`hidden_size_per_layer_input` wide): its
row of `embed_tokens_per_layer` (all layers packed in one row, scaled by sqrt(width)) plus a
projection of its scaled token embedding (times 1/sqrt(hidden), RMS-normed per layer), the sum
times 1/sqrt(2). Each layer gates its slice with its output and adds the projection back.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache
from engine.attention.metadata import AttentionMetadata
from engine.layers.gelu_and_mul import GeluTanhAndMul
from engine.layers.linear import linear
from engine.layers.parallel_linear import LoraPass
from engine.layers.rope import RotaryEmbedding
from engine.layers.vocab_embedding import VocabParallelEmbedding
from engine.models.gemma4_config import Gemma4Config
from engine.models.gemma4_layers import (
    Gemma4Attention,
    Gemma4Experts,
    Gemma4MLP,
    Gemma4RMSNorm,
    Gemma4Router,
    SharedKV,
)
from engine.models.gemma4_sharding import Gemma4Sharding
from engine.models.hf_config import ModelConfig
from engine.parallel.tensor_parallel import TensorParallel


class PerLayerInputs(nn.Module):
    """The model's PLE tables; `forward`: [tokens] ids and their scaled embeddings ->
    [tokens, layers, width], every layer's input. Its tensors are the model's in the checkpoint
    (`model.embed_tokens_per_layer`, ...): the model registers them itself (`attach`)."""

    def __init__(
        self, cfg: ModelConfig, gemma: Gemma4Config, shard: Gemma4Sharding, tp: TensorParallel
    ) -> None:
        super().__init__()
        width, layers = gemma.per_layer_input_size, cfg.num_layers
        self.width, self.layers = width, layers
        self.embed_tokens_per_layer = VocabParallelEmbedding(
            shard.per_layer_vocab_size,
            layers * width,
            shard.rank * shard.per_layer_vocab_size,
            tp,
            width**0.5,
        )
        self.per_layer_model_projection = nn.Linear(cfg.hidden_size, layers * width, bias=False)
        self.projection_scale = cfg.hidden_size**-0.5
        self.per_layer_projection_norm = Gemma4RMSNorm(width, cfg.rms_norm_eps)

    def forward(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        tokens = ids.shape[0]
        own = self.embed_tokens_per_layer(ids).view(tokens, self.layers, self.width)
        projected = linear(embeds, self.per_layer_model_projection.weight, None)
        projected = (projected * self.projection_scale).view(tokens, self.layers, self.width)
        return (self.per_layer_projection_norm(projected) + own) * 2.0**-0.5


class PerLayerGate(nn.Module):
    """A layer's use of its per-layer input: project(gelu_tanh(gate(h)) * input), normed. Its
    modules are the decoder layer's in the checkpoint (`layers.{i}.per_layer_input_gate`, ...)."""

    def __init__(self, hidden: int, width: int, eps: float) -> None:
        super().__init__()
        self.per_layer_input_gate = nn.Linear(hidden, width, bias=False)
        self.per_layer_projection = nn.Linear(width, hidden, bias=False)
        self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.act = GeluTanhAndMul()

    def forward(self, h: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        gate = linear(h, self.per_layer_input_gate.weight, None)
        out = linear(self.act(gate, per_layer_input), self.per_layer_projection.weight, None)
        return self.post_per_layer_input_norm(out)


class Gemma4Moe(nn.Module):
    """A layer's experts beside its MLP: the router reads the residual stream, the experts its
    own norm of it; each of the MLP's and the experts' outputs is normed, and they are summed.
    Its modules are the decoder layer's in the checkpoint (`layers.{i}.router`, ...)."""

    def __init__(
        self,
        hidden: int,
        gemma: Gemma4Config,
        shard: Gemma4Sharding,
        tp: TensorParallel,
        eps: float,
    ) -> None:
        super().__init__()
        assert gemma.moe is not None
        self.router = Gemma4Router(hidden, gemma.moe, eps)
        self.experts = Gemma4Experts(hidden, gemma.moe, shard.expert_start, shard.num_experts, tp)
        self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)

    def forward(
        self, h: torch.Tensor, mlp_out: torch.Tensor, routing: list[torch.Tensor] | None
    ) -> torch.Tensor:  # the feed-forward's output, before the post-feed-forward norm
        weights, ids = self.router(h)
        if routing is not None:
            routing.append(ids)
        routed = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
        return self.post_feedforward_layernorm_1(mlp_out) + self.post_feedforward_layernorm_2(
            routed
        )


class Gemma4DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        gemma: Gemma4Config,
        shard: Gemma4Sharding,
        tp: TensorParallel,
        index: int,
    ) -> None:
        super().__init__()
        spec, eps, hidden = gemma.layers[index], cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Gemma4Attention(
            spec, hidden, shard.num_heads, shard.num_kv_heads[index], eps, gemma.attention_bias, tp
        )
        self.mlp = Gemma4MLP(hidden, shard.intermediate_size[index], tp)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.moe: Gemma4Moe | None = None
        if gemma.moe is not None:
            self.moe = Gemma4Moe(hidden, gemma, shard, tp, eps)
        self.ple: PerLayerGate | None = None
        if gemma.per_layer_input_size:
            self.ple = PerLayerGate(hidden, gemma.per_layer_input_size, eps)
        self.layer_scalar: torch.Tensor
        self.register_buffer("layer_scalar", torch.ones(1))  # loaded: the checkpoint's

    def forward(
        self,
        h: torch.Tensor,  # [tokens, hidden]: the residual stream
        per_layer_input: torch.Tensor | None,  # [tokens, width]
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        cache: KVCache | None,
        meta: AttentionMetadata,
        shared: SharedKV | None,
        lora: LoraPass | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, SharedKV]:  # (the stream after this layer, its K and V)
        attended, kv = self.self_attn(
            self.input_layernorm(h), positions, rotary, backend, cache, meta, shared, lora
        )
        h = h + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(h), lora)
        if self.moe is not None:
            out = self.moe(h, out, routing)
        h = h + self.post_feedforward_layernorm(out)
        if self.ple is not None:
            assert per_layer_input is not None
            h = h + self.ple(h, per_layer_input)
        return h * self.layer_scalar, kv
