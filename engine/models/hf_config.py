"""Reads a Hugging Face checkpoint's config.json (and generation_config.json) into ModelConfig.

Hub checkpoints were mostly written by transformers 4.x (top-level `rope_theta`, `rope_scaling`
with `rope_type` or the older `type`, `torch_dtype`); transformers 5.x writes `rope_parameters`
and `dtype`. Both are read. Mixture-of-experts checkpoints (Qwen2-MoE, Qwen3-MoE, Mixtral) add
a `MoeConfig`, read with the keys and defaults of transformers' own config classes. Anything
this engine would compute differently from transformers is refused with an error that names
the key, never silently ignored.

ModelConfig holds what every family reads alike; a family with keys of its own (Gemma's soft
caps, gpt-oss's sinks ...) reads them from `raw`, the whole config.json, when its model is
built, and refuses there, by name, what it cannot compute. The Llama family's own checks
(its activation, its sliding window) run here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models import gpt_oss_config
from engine.models.llama_family import PLAIN, VARIANTS
from engine.models.registry import ARCHITECTURES
from engine.moe.config import MoeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "proportional", "yarn")
# The architectures whose model rotates part of each head (`partial_rotary_factor` < 1).
PARTIAL_ROTARY = ("Phi3ForCausalLM",)


class UnsupportedModelError(ValueError):
    """The checkpoint needs something this engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "linear"|"llama3"|"yarn", ...}
    max_position_embeddings: int
    max_model_len: int  # what the engine serves: max_position_embeddings capped by the caller
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None
    moe: MoeConfig | None = None  # None: every layer's MLP is dense
    hidden_act: str = "silu"  # `hidden_act`, or Gemma's `hidden_activation`
    # Per layer, as transformers 5 names them ("full_attention", "sliding_attention"); empty
    # when config.json has no `layer_types` (every layer full, unless the family says otherwise).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # `sliding_window`, for the layers that slide
    partial_rotary_factor: float = 1.0  # the rotated fraction of each head (PARTIAL_ROTARY)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json


def load_model_config(directory: str | Path, max_model_len: int | None = None) -> ModelConfig:
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint: no config.json")
    raw: dict[str, Any] = json.loads(config_path.read_text())
    generation_path = directory / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    return parse_model_config(raw, generation, max_model_len)


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any], max_model_len: int | None = None
) -> ModelConfig:
    architecture = _architecture(raw)
    variant = VARIANTS.get(architecture, PLAIN)  # another family: its config says it all
    moe = None
    if architecture == gpt_oss_config.ARCHITECTURE:  # its defaults, refusals and experts
        try:
            raw, moe = gpt_oss_config.read_gpt_oss(raw)
        except gpt_oss_config.GptOssConfigError as err:
            raise UnsupportedModelError(str(err)) from None
    qkv_bias, o_bias, qk_norm = variant.qkv_bias, variant.o_bias, variant.qk_norm
    attention_bias = bool(raw.get("attention_bias", False))
    if architecture == "Qwen2MoeForCausalLM":
        qkv_bias = bool(raw.get("qkv_bias", True))  # 4.x checkpoints lack the key: always bias

    act = str(raw.get("hidden_act") or raw.get("hidden_activation") or "silu")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedModelError("pretraining_tp > 1 is not supported")
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    rope_theta, rope_scaling, partial = _rope(raw, architecture, int(head_dim))
    max_positions = int(raw.get("max_position_embeddings", 2048))
    served_len = min(max_positions, max_model_len) if max_model_len else max_positions
    if architecture in VARIANTS:
        _check_llama_family(raw, act, served_len, VARIANTS[architecture].sliding)
    window = raw.get("sliding_window")

    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        max_model_len=served_len,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=qk_norm,
        eos_token_ids=eos_ids,
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        moe=_moe(raw, architecture) if variant.moe else moe or _family_moe(raw, architecture),
        hidden_act=act,
        layer_types=tuple(raw.get("layer_types") or ()),
        sliding_window=None if window is None else int(window),
        partial_rotary_factor=partial,
        raw=raw,
    )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return str(arch)
    named = ", ".join(archs) if archs else f"model_type={raw.get('model_type')!r}"
    raise UnsupportedModelError(
        f"architecture {named} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )


def _moe(raw: dict[str, Any], architecture: str) -> MoeConfig:
    """The MoE keys as transformers names them: Mixtral's `num_local_experts` (every layer
    sparse, top-k always renormalised, expert size `intermediate_size`); Qwen's `num_experts`
    (transformers 5 saves Qwen3-MoE's as `num_local_experts`), `moe_intermediate_size`,
    `norm_topk_prob`, `decoder_sparse_step` and `mlp_only_layers` (dense layers)."""
    num_layers = int(raw["num_hidden_layers"])
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be within 1..{num_experts} (the experts)"
        )
    if architecture == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
            weights_in_float32=True,
            shared_expert_intermediate_size=0,
            sparse_layers=tuple(range(num_layers)),
        )
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step={step} is not supported (must be >= 1)")
    dense = set(raw.get("mlp_only_layers") or ())
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":
        shared = int(raw["shared_expert_intermediate_size"])
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        weights_in_float32=False,
        shared_expert_intermediate_size=shared,
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )


def _family_moe(raw: dict[str, Any], architecture: str) -> MoeConfig | None:
    """The experts of a family outside the Llama rows that names them its own way (Gemma 4),
    its whole config checked here, at load, so that what it cannot compute is refused before
    any model is built."""
    if architecture != "Gemma4ForCausalLM":
        return None
    from engine.models.gemma4_config import UnsupportedGemma4Error, parse_gemma4

    try:
        return parse_gemma4(raw).moe
    except UnsupportedGemma4Error as error:
        raise UnsupportedModelError(str(error)) from None


def _rope(
    raw: dict[str, Any], architecture: str, head_dim: int
) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling, partial_rotary_factor) from transformers 5.x `rope_parameters`
    or 4.x top-level keys."""
    params = raw.get("rope_parameters")
    if params is not None and "rope_theta" not in params and params:
        # 5.x may nest per layer type ({"full_attention": {...}}); all our layers are full.
        params = params.get("full_attention", params)
    scaling = dict(params) if params else dict(raw.get("rope_scaling") or {})
    theta = float((params or {}).get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    partial = 1.0  # proportional rope keeps its fraction: it shapes the frequencies, not the tables
    if rope_type != "proportional":
        # 5.x keeps the factor in rope_parameters, 4.x at the top level.
        given = scaling.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor")
        partial = float(given or 1.0)
    if partial != 1.0 and architecture not in PARTIAL_ROTARY:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial} must rotate an even number of each head's "
            f"{head_dim} dimensions"
        )
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's older names for it, renamed as transformers does
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "longrope":
        _longrope(raw, scaling, int(head_dim * partial))
    if rope_type == "yarn":  # transformers' defaults (standardize_rope_params, YaRN's own)
        positions = int(raw.get("max_position_embeddings", 2048))
        old_len = scaling.get("original_max_position_embeddings") or positions
        scaling["original_max_position_embeddings"] = old_len
        if scaling.get("factor") is None:
            scaling["factor"] = positions / old_len
    return theta, {"rope_type": rope_type, **scaling}, partial


def _longrope(raw: dict[str, Any], scaling: dict[str, Any], rotary_dim: int) -> None:
    """Completes `scaling` as transformers reads it: `original_max_position_embeddings` from
    the top level (4.x), `factor` as max_position_embeddings / original when absent; refuses
    factor lists that do not give each of the rotary_dim / 2 frequencies one."""
    original = scaling.get("original_max_position_embeddings")
    original = original or raw.get("original_max_position_embeddings")
    if not original:
        raise UnsupportedModelError("longrope needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original)
    if scaling.get("factor") is None:
        scaling["factor"] = int(raw.get("max_position_embeddings", 2048)) / int(original)
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
            raise UnsupportedModelError(
                f"rope_scaling.{key} must list {rotary_dim // 2} numbers (one per frequency "
                f"of the {rotary_dim} rotated dimensions)"
            )


def _check_llama_family(raw: dict[str, Any], act: str, served_len: int, sliding: str) -> None:
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
    window = raw.get("sliding_window")
    if sliding:  # Mistral, Qwen2, Qwen3: their windows are computed (llama_family.py)
        return
    # Qwen2/2.5 carry sliding_window with use_sliding_window: false (no window is used).
    if window is None or raw.get("use_sliding_window") is False:
        return
    if int(window) < served_len:
        raise UnsupportedModelError(
            f"sliding_window={window} is smaller than the served context ({served_len}); "
            "sliding-window attention is not supported for this architecture: "
            "pass max_model_len <= sliding_window"
        )
