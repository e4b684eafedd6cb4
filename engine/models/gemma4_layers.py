"""Gemma 4's sublayers: its RMSNorm, attention, MLP and mixture of experts, as transformers 5.23
computes them (Gemma4RMSNorm, Gemma4TextAttention, Gemma4TextMLP, Gemma4TextRouter and
Gemma4TextExperts).

Module names are the checkpoint's, except that q/k/v merge into one `qkv_proj` and gate/up
into one `gate_up_proj` (MergedLinear names each part by its checkpoint name); the experts'
stacked tensors are the checkpoint's own (`experts.gate_up_proj` [experts, 2 * inter, hidden],
`experts.down_proj` [experts, hidden, inter]).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache, LayerAttention
from engine.attention.metadata import AttentionMetadata
from engine.layers.gelu_and_mul import GeluTanhAndMul
from engine.layers.linear import linear
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import LoraPass, RowParallelLinear
from engine.layers.rope import RotaryEmbedding
from engine.models.gemma4_config import Gemma4Layer
from engine.moe.config import MoeConfig
from engine.moe.experts import StackedExperts
from engine.parallel.tensor_parallel import TensorParallel

SharedKV = tuple[torch.Tensor, torch.Tensor]  # a layer's K (before rope) and V of the step


class Gemma4RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), times the weight (none when `scale` is False), all in float32,
    then cast back: Gemma 4's weight multiplies as it is (not Gemma 2/3's 1 + weight)."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        # NOTE: pow(-0.5), not rsqrt, as transformers (and JAX) compute it.
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


class Gemma4Attention(nn.Module):
    """Attention at scale 1 with q and k RMS-normed per head and v normed without a weight; a
    sliding layer attends to its window. A layer that owns its KV projects k (and v, unless
    k_eq_v: its values are its keys before norm and rope); a sharing layer projects q only and
    attends to its source layer's K and V."""

    def __init__(
        self,
        layer: Gemma4Layer,
        hidden: int,
        heads: int,
        kv_heads: int,
        eps: float,
        bias: bool,
        tp: TensorParallel,
    ) -> None:
        """`heads`, `kv_heads`: this rank's."""
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, layer.head_dim
        self.owns_kv, self.k_eq_v = layer.owns_kv, layer.k_eq_v
        q_size, kv_size = heads * layer.head_dim, kv_heads * layer.head_dim
        parts = {"q_proj": q_size}
        if layer.owns_kv:
            parts["k_proj"] = kv_size
            if not layer.k_eq_v:
                parts["v_proj"] = kv_size
        self.qkv_proj = MergedLinear(hidden, parts, bias)
        self.o_proj = RowParallelLinear(q_size, hidden, bias, tp)
        self.q_norm = Gemma4RMSNorm(layer.head_dim, eps)
        self.k_norm = Gemma4RMSNorm(layer.head_dim, eps) if layer.owns_kv else None
        self.v_norm = Gemma4RMSNorm(layer.head_dim, eps, scale=False)
        self.kind = LayerAttention(sliding_window=layer.sliding_window, scale=1.0)

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        cache: KVCache | None,
        meta: AttentionMetadata,
        shared: SharedKV | None,
        lora: LoraPass | None = None,
    ) -> tuple[torch.Tensor, SharedKV]:
        """(output [tokens, hidden], the K (normed, before rope) and V this layer attended to).

        A sharing layer passes its source's K and V (`shared`) on to the backend with the
        source's cache: the backend writes them to the slots they already hold, the same bits
        (its interface has no read-only attention), and attends over the source's context."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add(self.qkv_proj, x, qkv)
        split = qkv.split(self.qkv_proj.sizes, dim=-1)
        q = self.q_norm(split[0].view(tokens, self.heads, self.head_dim))
        if self.k_norm is None:
            assert shared is not None, "a sharing layer runs after its source"
            k, v = shared
        else:
            k_raw = split[1].view(tokens, self.kv_heads, self.head_dim)
            v_raw = k_raw if self.k_eq_v else split[2].view(tokens, self.kv_heads, self.head_dim)
            k, v = self.k_norm(k_raw), self.v_norm(v_raw)
        out = backend.forward(q, k, v, positions, rotary, cache, meta, self.kind)
        return self.o_proj(out.reshape(tokens, -1), lora), (k, v)


class Gemma4MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); `inter` this rank's width (a double-wide layer's is
    twice intermediate_size)."""

    def __init__(self, hidden: int, inter: int, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inter, "up_proj": inter}, False)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor, lora: LoraPass | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add(self.gate_up_proj, x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate, up), lora)


class Gemma4Router(nn.Module):
    """Scores the layer's input (the residual stream, not the MLP's normed input): RMS-normed
    without a weight, times `scale` and 1/sqrt(hidden), projected; softmax in float32, top-k,
    renormalised, each weight then times its expert's `per_expert_scale`."""

    def __init__(self, hidden: int, moe: MoeConfig, eps: float) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.root = hidden**-0.5
        self.norm = Gemma4RMSNorm(hidden, eps, scale=False)
        self.proj = nn.Linear(hidden, moe.num_experts, bias=False)  # replicated
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32, expert ids), each [tokens, top_k], highest probability first."""
        h = self.norm(x) * self.scale * self.root
        probs = torch.softmax(linear(h, self.proj.weight, None), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """This rank's experts (engine/moe's StackedExperts with GeLU-tanh), split by expert: the
    pairs routed to another rank's experts weigh 0 here (their rank adds them in the block's
    all-reduce). `experts.gate_up_proj` / `experts.down_proj` are the stacked parameters."""

    def __init__(
        self, hidden: int, moe: MoeConfig, first: int, count: int, tp: TensorParallel
    ) -> None:
        """`first`, `count`: this rank's experts."""
        super().__init__()
        self.first, self.count, self.tp = first, count, tp
        parts = ("gate_proj", "up_proj", "down_proj")
        self.stack = StackedExperts(
            count, hidden, moe.expert_intermediate_size, parts, GeluTanhAndMul()
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.enabled:  # NOTE: shapes kept (no filtering by content): graph-capturable
            local = ids - self.first
            mine = (local >= 0) & (local < self.count)
            ids, weights = local.clamp(0, self.count - 1), weights * mine
        return self.tp.all_reduce(self.stack(x, weights, ids))
