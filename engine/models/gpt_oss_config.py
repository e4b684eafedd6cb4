"""gpt-oss's config.json keys, read as transformers' GptOssConfig reads them.

The config reader (engine/models/hf_config.py) calls `read_gpt_oss` for a `GptOssForCausalLM`
checkpoint before its common parse: it fills the keys GptOssConfig defaults differently from
the common reader (attention biases on, rms_norm_eps 1e-5, a 128-token window on every other
layer from the first, YaRN rope), refuses by name what Sluice cannot compute, and gives the
MoeConfig of its sparse feed-forward (every layer: a router with a bias, top-k then softmax,
experts with biases and a clamped SwiGLU). Stdlib only, like the registry.
"""

from __future__ import annotations

from typing import Any

from engine.moe.config import MoeConfig

ARCHITECTURE = "GptOssForCausalLM"
LAYER_KINDS = ("sliding_attention", "full_attention")

# GptOssConfig's defaults where the common reader's differ (transformers 5.23).
DEFAULTS: dict[str, Any] = {
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "sliding_window": 128,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


class GptOssConfigError(ValueError):
    """A gpt-oss key Sluice cannot honour (the config reader re-raises it as its own error)."""


def read_gpt_oss(raw: dict[str, Any]) -> tuple[dict[str, Any], MoeConfig]:
    """(config.json with GptOssConfig's defaults filled in, the MoE feed-forward); raises
    GptOssConfigError naming the key it cannot honour."""
    raw = {**DEFAULTS, **raw}
    raw.setdefault("rope_theta", DEFAULT_THETA)
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        raw["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": raw["rope_theta"]}
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    if len(kinds) != layers:
        raise GptOssConfigError(f"layer_types: {len(kinds)} entries for {layers} layers")
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise GptOssConfigError(f"layer_types: {unknown} not supported (only {LAYER_KINDS})")
    raw["layer_types"] = list(kinds)
    window = raw.get("sliding_window")
    if "sliding_attention" in kinds and (not isinstance(window, int) or window < 1):
        raise GptOssConfigError(f"sliding_window={window!r}: sliding layers need a window >= 1")
    return raw, _moe(raw, layers)


def _moe(raw: dict[str, Any], layers: int) -> MoeConfig:
    experts, top_k = int(raw["num_local_experts"]), int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise GptOssConfigError(
            f"num_experts_per_tok={top_k} must be within 1..{experts} (num_local_experts)"
        )
    alpha = float(raw.get("swiglu_alpha", SWIGLU_ALPHA))
    limit = float(raw.get("swiglu_limit", SWIGLU_LIMIT))
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=False,
        weights_in_float32=False,
        shared_expert_intermediate_size=0,
        sparse_layers=tuple(range(layers)),
        softmax_after_topk=True,
        router_bias=True,
        expert_bias=True,
        clamped_swiglu=(alpha, limit),
    )
