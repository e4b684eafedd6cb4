"""Gemma 2 and Gemma 3 (text) as transformers 5.23 computes them.

Llama's layer with Gemma's differences (engine/models/gemma_config.py reads their keys):
embeddings scaled by sqrt(hidden_size) in the model dtype; every RMSNorm scales by (1 + weight)
in float32 (engine/layers/gemma_rms_norm.py), and each sublayer has a norm before and after it
(`input_layernorm` / `post_attention_layernorm` around attention, `pre_feedforward_layernorm` /
`post_feedforward_layernorm` around the MLP); a GeLU-tanh gated MLP; attention at
`query_pre_attn_scalar` ** -0.5, sliding-window or full per `layer_types`; Gemma 2 soft-caps
the attention scores and the final logits; Gemma 3 RMS-norms q and k per head and rotates its
sliding layers with a local rope base and its full layers with the global base and scaling (two
rotary tables, each layer reads its kind's). The LM head is tied to the embedding unless the
config unties it.

Checkpoint names, merged projections, tensor parallelism (engine/models/sharding.py: the
Llama family's table, whose names Gemma's checkpoints share; the extra norms are replicated)
and LoRA (q/k/v/o, gate/up/down) work as for the Llama family (engine/models/llama.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.layers.gelu_and_mul import GeluTanhAndMul
from engine.layers.gemma_rms_norm import GemmaRMSNorm
from engine.layers.parallel_linear import LoraPass
from engine.layers.rope import RotaryEmbedding
from engine.layers.vocab_embedding import VocabParallelEmbedding
from engine.models.base import KVLayout, LayerKV
from engine.models.gemma_config import FULL, SLIDING, GemmaConfig, gemma_config
from engine.models.hf_config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaMLP, LlamaShapedLM
from engine.models.sharding import Sharding
from engine.parallel.tensor_parallel import TensorParallel


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, gemma: GemmaConfig, shard: Sharding, tp: TensorParallel, index: int
    ) -> None:
        super().__init__()
        window = gemma.window if gemma.sliding(index) else None
        layer = LayerAttention(window, gemma.scale, gemma.attn_softcap)
        norm = GemmaRMSNorm if gemma.qk_norm else None  # Gemma 3's q/k norms
        self.self_attn = LlamaAttention(cfg, shard, tp, layer, norm)
        self.mlp = LlamaMLP(cfg, shard, tp, GeluTanhAndMul())
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

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
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (post-MLP-norm output, residual), not yet summed
        # The pre-norms add the sublayer output before them to the stream; the post-norms
        # normalise a sublayer's output before it joins the stream.
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(
            self.self_attn(h, positions, rotary, backend, cache, meta, lora)
        )
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, lora)), residual


class GemmaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, gemma: GemmaConfig, shard: Sharding, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            shard.vocab_size, cfg.hidden_size, shard.vocab_start, tp, scale=cfg.hidden_size**0.5
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, gemma, shard, tp, i) for i in range(cfg.num_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(LlamaShapedLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (engine/models/gemma_config.py says which keys
    tell them apart)."""

    model: GemmaModel

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        triton_kernels: bool = False,
    ) -> None:
        """`triton_kernels` is accepted for the interface: Gemma's norms and activation have
        no Triton kernels (their modules say why), and its attention is the backend's."""
        super().__init__(cfg, backend, tp, triton_kernels)
        self.config = cfg
        self.gemma = gemma_config(cfg)
        self.backend = backend
        self.tp = tp or TensorParallel()
        self.sharding: Sharding = self.shard_layout(cfg, self.tp.rank, self.tp.size)
        self.model = GemmaModel(cfg, self.gemma, self.sharding, self.tp)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, self.sharding.vocab_size, bias=False)
        self.rotary = self._rotary_tables()

    def _rotary_tables(self) -> dict[str, RotaryEmbedding]:
        """One table per layer kind, in float32 (a plain dict: buffers computed, not loaded)."""
        cfg, gemma = self.config, self.gemma
        full = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling)
        same = (gemma.local_theta, gemma.local_scaling) == (cfg.rope_theta, cfg.rope_scaling)
        local = (
            full
            if same
            else RotaryEmbedding(
                cfg.head_dim, cfg.max_model_len, gemma.local_theta, gemma.local_scaling
            )
        )
        return {FULL: full, SLIDING: local}

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        meta: AttentionMetadata,
        kv_caches: list[KVCache] | None,
        lora: LoraPass | None = None,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [tokens, hidden], after the final norm
        """`routing` is ignored: Gemma 2 and 3 have no experts."""
        if kv_caches is not None:
            self.backend.prepare(meta)
        h = self.model.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.model.layers):
            cache = kv_caches[i] if kv_caches is not None else None
            rotary = self.rotary[self.gemma.layer_types[i]]
            h, residual = layer(h, residual, positions, rotary, self.backend, cache, meta, lora)
        assert residual is not None, "a model has at least one layer"
        h, _ = self.model.norm(h, residual)  # with the last layer's residual add
        return h

    @property
    def kv_layout(self) -> KVLayout:
        kv_heads, head_dim = self.sharding.num_kv_heads, self.config.head_dim
        layers = tuple(
            LayerKV(kv_heads, head_dim, self.gemma.window if self.gemma.sliding(i) else None)
            for i in range(self.config.num_layers)
        )
        return KVLayout(self.config.num_layers, kv_heads, head_dim, layers)

    def init_buffers(self, device: torch.device) -> None:
        self.rotary = {kind: table.to(device) for kind, table in self._rotary_tables().items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        logits = super().compute_logits(hidden)
        cap = self.gemma.final_softcap
        if cap is None:
            return logits
        # As transformers: divide, tanh, multiply, each rounded to the model dtype (in
        # bfloat16, steps of 1/8 near a cap of 30: ties that argmax breaks by index, as HF's).
        capped = torch.tanh(logits.to(hidden.dtype) / cap) * cap
        return capped.float()
