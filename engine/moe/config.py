"""MoeConfig: the sparse feed-forward of a mixture-of-experts checkpoint, as the MoE block needs
it (a family's config reader fills it: engine/models/hf_config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward of a mixture-of-experts checkpoint (engine/moe/block.py).

    Routing as transformers computes it: softmax over the router logits in float32, the top-k,
    renormalised to sum to 1 when `norm_topk_prob`; the weights are then cast to the model's
    dtype (Qwen) or kept in float32 (Mixtral: `weights_in_float32`) for the weighted sum.
    gpt-oss routes the other way round (`softmax_after_topk`: the top-k logits, then a softmax
    over them in the logits' dtype), through a router with a bias, to experts with biases whose
    activation is a clamped SwiGLU (`clamped_swiglu`: engine/moe/clamped_swiglu.py).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    weights_in_float32: bool
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has a gated one)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE block; the rest are dense
    softmax_after_topk: bool = False  # gpt-oss: top-k of the logits, softmax over those k
    router_bias: bool = False  # the router's linear has a bias (gpt-oss)
    expert_bias: bool = False  # each expert's gate/up and down projections have biases
    clamped_swiglu: tuple[float, float] | None = None  # (alpha, limit); None: SiLU(gate) * up
