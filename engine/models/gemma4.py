"""Gemma 4 (text), dense and mixture-of-experts, as transformers 5.23's Gemma4ForCausalLM
computes it (`model_type: gemma4_text`; engine/models/gemma4_config.py reads its config).

A layer: attention (engine/models/gemma4_layers.py) between an input and a post-attention
norm; then the MLP between a pre- and a post-feed-forward norm (with experts, the MLP's output
and the experts' each get a norm of their own and are summed before the post-feed-forward
norm; the router reads the residual stream); then, with per-layer input embeddings (PLE), a
gated projection of this layer's slice of them; finally the whole stream times the layer's
`layer_scalar`. The token embedding is scaled by sqrt(hidden_size); the LM head (tied to the
embedding by default) is soft-capped by `final_logit_softcapping`.

Sliding and full layers differ in head size, KV heads and rope (default rope on sliding
layers, proportional rope rotating a fraction of each head on full ones: one RotaryEmbedding
per layer kind). The last `num_kv_shared_layers` layers hold no KV cache: each attends to the
K and V of the last earlier layer of its kind (`kv_layout` lists the layers that own a cache;
the forward hands a sharing layer its source's cache).

KV cache shapes: `kv_layout.layers` gives each cache-owning layer its own (KV heads, head
size, window), and the page pool allocates each at that shape (engine/kv_cache/kv_groups.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache
from engine.attention.metadata import AttentionMetadata
from engine.layers.linear import linear
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import LoraPass, RowParallelLinear
from engine.layers.rope import RotaryEmbedding
from engine.layers.vocab_embedding import VocabParallelEmbedding
from engine.models.base import CausalLM, KVLayout, LayerKV, LoraTarget
from engine.models.gemma4_config import Gemma4Config, parse_gemma4
from engine.models.gemma4_decoder import Gemma4DecoderLayer, PerLayerInputs
from engine.models.gemma4_layers import Gemma4Experts, Gemma4RMSNorm, SharedKV
from engine.models.gemma4_sharding import Gemma4Sharding
from engine.models.hf_config import ModelConfig
from engine.moe.experts import StackedExperts
from engine.parallel.tensor_parallel import TensorParallel

# Modules that group a layer's (or the model's) checkpoint tensors without a name of their own
# in the checkpoint: `layers.3.moe.router.proj` is `layers.3.router.proj`.
UNNAMED = frozenset({"moe", "ple", "per_layer"})


class Gemma4Model(nn.Module):
    def __init__(
        self, cfg: ModelConfig, gemma: Gemma4Config, shard: Gemma4Sharding, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            shard.vocab_size, cfg.hidden_size, shard.vocab_start, tp, cfg.hidden_size**0.5
        )
        self.per_layer = (
            PerLayerInputs(cfg, gemma, shard, tp) if gemma.per_layer_input_size else None
        )
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(cfg, gemma, shard, tp, i) for i in range(cfg.num_layers)
        )
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma4ForCausalLM(CausalLM):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        triton_kernels: bool = False,
    ) -> None:
        """`triton_kernels`: the experts' grouped GEMMs run engine/layers' Triton kernel; the
        norms and activations are torch code."""
        super().__init__(cfg, backend, tp, triton_kernels)
        self.config = cfg
        self.gemma = parse_gemma4(cfg.raw)
        self.backend = backend
        self.tp = tp or TensorParallel()
        self.sharding: Gemma4Sharding = Gemma4Sharding(cfg, self.gemma, self.tp.rank, self.tp.size)
        self.model = Gemma4Model(cfg, self.gemma, self.sharding, self.tp)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, self.sharding.vocab_size, bias=False)
        owners = self.gemma.cache_layers
        # Each layer's cache in kv_caches: its own, or its source's.
        self.cache_index = [
            owners.index(i if layer.owns_kv else layer.kv_source)
            for i, layer in enumerate(self.gemma.layers)
        ]
        self.rotary = self._rotary()
        for module in self.modules():
            if isinstance(module, StackedExperts):
                module.triton = triton_kernels

    @classmethod
    def shard_layout(cls, cfg: ModelConfig, rank: int, size: int) -> Gemma4Sharding:
        return Gemma4Sharding(cfg, parse_gemma4(cfg.raw), rank, size)

    def _rotary(self) -> nn.ModuleDict:
        """One rotary table per layer kind, at that kind's head size (float32)."""
        tables = {}
        for kind, rope in self.gemma.rope.items():
            head_dim = next(layer.head_dim for layer in self.gemma.layers if layer.kind == kind)
            tables[kind] = RotaryEmbedding(
                head_dim, self.config.max_model_len, rope.theta, rope.scaling
            )
        return nn.ModuleDict(tables)

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        meta: AttentionMetadata,
        kv_caches: list[KVCache] | None,
        lora: LoraPass | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [tokens, hidden], after the final norm
        if kv_caches is not None:
            self.backend.prepare(meta)
        h = self.model.embed_tokens(input_ids)
        per_layer = None if self.model.per_layer is None else self.model.per_layer(input_ids, h)
        shared: dict[int, SharedKV] = {}  # each cache-owning layer's K and V, for its sharers
        for i, layer in enumerate(self.model.layers):
            spec = self.gemma.layers[i]
            cache = None if kv_caches is None else kv_caches[self.cache_index[i]]
            h, kv = layer(
                h,
                None if per_layer is None else per_layer[:, i],
                positions,
                self.rotary[spec.kind],
                self.backend,
                cache,
                meta,
                shared.get(spec.kv_source),
                lora,
                routing,
            )
            if spec.owns_kv:
                shared[i] = kv
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        logits = self.tp.gather_vocab(linear(hidden, self.head_weight, None))
        cap = self.gemma.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: its own, or the (unscaled) embedding's when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def kv_layout(self) -> KVLayout:
        """The cache-owning layers only (a sharing layer reads its source's cache); the uniform
        shape is the largest layer's, which the pool allocates for every layer until it
        honours `layers`."""
        layers = tuple(
            LayerKV(self.sharding.num_kv_heads[i], spec.head_dim, spec.sliding_window)
            for i, spec in enumerate(self.gemma.layers)
            if spec.owns_kv
        )
        largest = max(layers, key=lambda kv: kv.num_kv_heads * kv.head_dim)
        return KVLayout(len(layers), largest.num_kv_heads, largest.head_dim, layers)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor by its Hugging Face name -> this rank's part (views of the
        parameters and buffers, outside autograd): q/k/v and gate/up as rows of their merged
        projections, the experts' stacks and `layer_scalar` as they are."""
        tensors: dict[str, torch.Tensor] = {}
        for path, module in self.named_modules():
            prefix = ".".join(part for part in path.split(".") if part not in UNNAMED)
            if isinstance(module, MergedLinear):  # its parts are its parent's projections
                prefix = prefix.rpartition(".")[0]
                local = module.checkpoint_tensors()
            elif isinstance(module, Gemma4Experts):
                stack = module.stack
                local = {"gate_up_proj": stack.gate_up_proj, "down_proj": stack.down_proj}
                local = {name: t.detach() for name, t in local.items()}
            elif isinstance(module, StackedExperts):
                continue  # named by its Gemma4Experts above
            else:
                local = {name: p.detach() for name, p in module.named_parameters(recurse=False)}
                local |= {
                    name: b.detach()
                    for name, b in module.named_buffers(recurse=False)
                    if name == "layer_scalar"
                }
            tensors |= {f"{prefix}.{name}".lstrip("."): t for name, t in local.items()}
        return tensors

    def linear_weights(self) -> list[torch.Tensor]:
        """The projections', the router's, the per-layer inputs' and the LM head's weights."""
        projections = [
            m.weight
            for m in self.modules()
            if isinstance(m, MergedLinear | RowParallelLinear | nn.Linear) and m is not self.lm_head
        ]
        return [*projections, self.head_weight]

    def lora_targets(self) -> dict[str, LoraTarget]:
        """The attention projections and the dense MLPs' (the experts take no adapter)."""
        return {
            name: module
            for name, module in self.named_modules()
            if isinstance(module, MergedLinear | RowParallelLinear)
        }

    def init_buffers(self, device: torch.device) -> None:
        self.rotary = self._rotary().to(device)  # float32, whatever the weights' dtype
