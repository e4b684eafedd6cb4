"""One implementation of the Llama family as Hugging Face configs describe it.

Llama 2/3/3.1/3.2 (rope scaling linear / llama3), Mistral, Qwen2/2.5 (q/k/v bias),
Qwen3 (q/k RMSNorm per head, explicit head_dim); grouped-query attention; tied or untied
embeddings; and their mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE, whose sparse
layers' MLP is an MoE block (engine/moe/block.py); engine/models/llama_family.py has one row
per member. Module and parameter names equal the
checkpoint's, except that q/k/v are merged into one `qkv_proj`, gate/up into one `gate_up_proj`
(engine/layers/merged_linear.py) and the experts into stacked tensors: `checkpoint_tensors()`
names every tensor by its checkpoint name, so weights load by name.

The forward pass takes a packed batch: every sequence's new tokens concatenated into one
[tokens] vector, with positions and attention metadata saying where each sequence's KV lives.

Tensor parallelism (engine/models/sharding.py says which slice each rank holds): the modules
are built at their local sizes, and each layer runs two all-reduces (after o_proj and after
down_proj); the embedding runs one, and the LM head one all-gather of the vocabulary slices.
With one rank these collectives are the identity and every module is whole.

LoRA: a step whose requests select adapters passes a LoraPass (engine/lora/) that adds each
adapter's delta to the projections' outputs of its tokens (o_proj, down_proj: to each rank's
partial output, before their all-reduce); the base model's steps pass None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.backend import FULL, AttentionBackend, KVCache, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.layers.linear import linear
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import LoraPass, RowParallelLinear
from engine.layers.rms_norm import RMSNorm
from engine.layers.rope import RotaryEmbedding
from engine.layers.silu_and_mul import SiluAndMul
from engine.layers.vocab_embedding import VocabParallelEmbedding
from engine.models.base import CausalLM, KVLayout, LayerKV, LoraTarget
from engine.models.hf_config import ModelConfig
from engine.models.llama_family import PLAIN, VARIANTS, layer_windows
from engine.models.sharding import Sharding
from engine.moe.block import SparseMoeBlock
from engine.moe.experts import StackedExperts
from engine.parallel.tensor_parallel import TensorParallel


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        shard: Sharding,
        tp: TensorParallel,
        kind: LayerAttention = FULL,
        qk_norm: Callable[[int, float], nn.Module] | None = None,
    ) -> None:
        """`qk_norm`: the per-head norm of q and k, when the family's is not RMSNorm (Gemma 3's
        (1 + weight) norm); RMSNorm where `cfg.qk_norm` says so (Qwen3)."""
        super().__init__()
        self.kind = kind  # a sliding window (Mistral, Qwen2/3's upper layers), or plain
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads  # this rank's
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.o_bias, tp)
        norm = qk_norm or (RMSNorm if cfg.qk_norm else None)
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if norm else None

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
        q, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)  # strided column views
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotary on q and k, k and v into the cache, then attention.
        out = backend.forward(q, k, v, positions, rotary, cache, meta, self.kind)
        attended = out.reshape(tokens, -1)
        return self.o_proj(attended, lora)


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, shard: Sharding, tp: TensorParallel, act: nn.Module | None = None
    ) -> None:
        """`act(gate, up)`: SiluAndMul unless the family gates otherwise (Gemma: GeLU-tanh)."""
        super().__init__()
        inter = shard.intermediate_size  # this rank's
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, cfg.mlp_bias
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp)
        self.act = SiluAndMul() if act is None else act

    def forward(self, x: torch.Tensor, lora: LoraPass | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [tokens, 2 * inter]: gate half first
        if lora is not None:
            lora.add(self.gate_up_proj, x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act(gate, up)
        return self.down_proj(h, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Sharding, tp: TensorParallel, index: int) -> None:
        super().__init__()
        windows = layer_windows(VARIANTS.get(cfg.architecture, PLAIN), cfg.raw, cfg.max_model_len)
        kind = LayerAttention(sliding_window=windows[index]) if windows else FULL
        self.self_attn = LlamaAttention(cfg, shard, tp, kind)
        # Registered under the checkpoint's name: `mlp`, or Mixtral's `block_sparse_moe`.
        self.mlp_name = "mlp"
        mlp: nn.Module
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            variant = VARIANTS[cfg.architecture]  # its checkpoints' names for the block
            self.mlp_name = variant.moe_block
            mlp = SparseMoeBlock(
                cfg.hidden_size,
                cfg.moe,
                shard.expert_intermediate_size,
                shard.shared_expert_intermediate_size,
                variant.expert_parts,
                tp,
            )
        else:
            mlp = LlamaMLP(cfg, shard, tp)
        self.add_module(self.mlp_name, mlp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def feed_forward(self) -> nn.Module:
        """The layer's MLP: dense (LlamaMLP) or an MoE block, whatever its checkpoint name."""
        return self.get_submodule(self.mlp_name)

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
        # Each norm adds the sublayer output before it to the stream (one kernel on Triton);
        # layer 0 starts the stream at the embedding.
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rotary, backend, cache, meta, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        mlp = self.feed_forward  # an MoE block's experts take no adapter (one is refused)
        return (mlp(h, lora) if isinstance(mlp, LlamaMLP) else mlp(h, routing)), residual


# Builds decoder layer `index` (cfg, shard, tp, index): LlamaDecoderLayer, or a cousin family's
# layer of the same call (engine/models/gpt_oss.py).
DecoderLayer = Callable[[ModelConfig, Sharding, TensorParallel, int], nn.Module]


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, shard: Sharding, tp: TensorParallel, layer: DecoderLayer
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            shard.vocab_size, cfg.hidden_size, shard.vocab_start, tp
        )
        self.layers = nn.ModuleList(layer(cfg, shard, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaShapedLM(CausalLM):
    """What every model built of Llama's modules shares: `model.embed_tokens`, an optional
    `lm_head`, merged and row-parallel projections by their checkpoints' names, the Llama
    family's sharding table. Llama's family and Gemma 2/3 derive from it."""

    model: nn.Module  # with `embed_tokens`, `layers` and `norm`
    lm_head: nn.Linear | None

    @classmethod
    def shard_layout(cls, cfg: ModelConfig, rank: int, size: int) -> Sharding:
        return Sharding(cfg, rank, size)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, by its Hugging Face name, in module order (q, k, v
        before o_proj; gate, up before down_proj) -> this rank's part of it (its shape;
        Sharding.full_shape gives the whole one), outside autograd. All share the parameters'
        storage (the parts of merged projections are views of their rows, each expert's
        tensors views of the stacked experts): copying into one changes exactly that tensor of
        the served weights."""
        tensors: dict[str, torch.Tensor] = {}
        for prefix, module in self.named_modules():
            if isinstance(module, MergedLinear) and not module.fused:  # parts: its parent's
                prefix = prefix.rpartition(".")[0]
                local = module.checkpoint_tensors()
            elif isinstance(module, StackedExperts):  # `experts.{e}.gate_proj.weight`, ...
                local = module.checkpoint_tensors()
            else:
                local = {name: p.detach() for name, p in module.named_parameters(recurse=False)}
            tensors |= {f"{prefix}.{name}".lstrip("."): t for name, t in local.items()}
        return tensors

    def lora_targets(self) -> dict[str, LoraTarget]:
        """The attention projections and the dense MLPs' (an MoE block's, its shared
        expert's included, take no adapter)."""
        moe = tuple(f"{p}." for p, m in self.named_modules() if isinstance(m, SparseMoeBlock))
        return {
            name: module
            for name, module in self.named_modules()
            if isinstance(module, MergedLinear | RowParallelLinear)
            and not (moe and name.startswith(moe))
        }

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: its own, or the embedding's when they are tied."""
        if self.lm_head is not None:
            return self.lm_head.weight
        embedding = self.model.get_submodule("embed_tokens")
        assert isinstance(embedding, VocabParallelEmbedding)
        return embedding.weight

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights the forward passes to `linear` whole: the attention and dense MLP
        projections' and the LM head's (an MoE block's experts and router are not among them)."""
        projections = [
            m.weight for m in self.modules() if isinstance(m, MergedLinear | RowParallelLinear)
        ]
        return [*projections, self.head_weight]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        weight = self.head_weight
        # float32 straight from the GEMM where it can (the AMX path writes it in its one pass);
        # ranks gather their slices in the model's dtype, half the bytes.
        logits = linear(hidden, weight, None, out_float32=not self.tp.enabled)
        return self.tp.gather_vocab(logits).float()


class LlamaForCausalLM(LlamaShapedLM):
    # A family of this shape with decoder layers of its own (gpt-oss) subclasses this class,
    # naming its layer here, and inherits the rest: the forward pass, the LM head, checkpoint
    # names, LoRA targets.
    decoder_layer: DecoderLayer = LlamaDecoderLayer
    model: LlamaModel

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        triton_kernels: bool = False,
    ) -> None:
        """`triton_kernels`: the norms, the activation and the experts' grouped GEMMs run
        engine/layers' Triton kernels (engine/layers/kernel_choice.py says when); else their
        torch reference code."""
        super().__init__(cfg, backend, tp, triton_kernels)
        self.config = cfg
        self.backend = backend
        self.tp = tp or TensorParallel()
        self.sharding: Sharding = self.shard_layout(cfg, self.tp.rank, self.tp.size)
        self.model = LlamaModel(cfg, self.sharding, self.tp, self.decoder_layer)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, self.sharding.vocab_size, bias=False)
        self.rotary = self.make_rotary()
        for module in self.modules():
            if isinstance(module, RMSNorm | SiluAndMul | StackedExperts):
                module.triton = triton_kernels

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        meta: AttentionMetadata,
        kv_caches: list[KVCache] | None,
        lora: LoraPass | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [tokens, hidden], after the final norm
        """`routing`, when given, gains each MoE layer's expert ids [tokens, top_k], in layer
        order; None (every step that returns no routed experts) records nothing."""
        if kv_caches is not None:
            self.backend.prepare(meta)
        h = self.model.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.model.layers):
            cache = kv_caches[i] if kv_caches is not None else None
            h, residual = layer(
                h, residual, positions, self.rotary, self.backend, cache, meta, lora, routing
            )
        assert residual is not None, "a model has at least one layer"
        h, _ = self.model.norm(h, residual)  # with the last layer's residual add
        return h

    @property
    def kv_layout(self) -> KVLayout:
        cfg, kv_heads = self.config, self.sharding.num_kv_heads
        windows = layer_windows(VARIANTS.get(cfg.architecture, PLAIN), cfg.raw, cfg.max_model_len)
        layers = tuple(LayerKV(kv_heads, cfg.head_dim, w) for w in windows)
        return KVLayout(cfg.num_layers, kv_heads, cfg.head_dim, layers)

    def init_buffers(self, device: torch.device) -> None:
        self.rotary = self.make_rotary().to(device)

    def make_rotary(self) -> RotaryEmbedding:
        """The rotary tables over the served context, in float32 whatever the weights' dtype."""
        cfg = self.config
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        return RotaryEmbedding(
            cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, rotary_dim
        )
