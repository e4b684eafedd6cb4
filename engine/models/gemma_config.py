"""GemmaConfig: what Gemma 2 and Gemma 3 (text) read from config.json beyond ModelConfig.

Read with transformers 5.23's keys and defaults (Gemma2Config, Gemma3TextConfig), and the 4.x
names the published checkpoints carry (`rope_local_base_freq`, `sliding_window_pattern`,
top-level `rope_scaling` for the global layers). What Sluice cannot compute as transformers
does is refused by name (UnsupportedModelError), when the model is built.

Per layer: its kind (`layer_types`: Gemma 2 alternates sliding and full from layer 0, Gemma 3
has five sliding layers to one full one), its rope table (Gemma 3's sliding layers rotate with
the local base, 10k; the full ones with the global base and its scaling), and how it attends
(`query_pre_attn_scalar` ** -0.5 for a scale, Gemma 2's soft cap on the scores, the window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.layers.gelu_and_mul import GELU_TANH
from engine.models.hf_config import SUPPORTED_ROPE_TYPES, ModelConfig, UnsupportedModelError

FULL, SLIDING = "full_attention", "sliding_attention"
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
LOCAL_THETA = 10_000.0  # Gemma 3's default local base (Gemma3TextConfig.default_theta)
DEFAULT_WINDOW = 4096  # Gemma2Config's and Gemma3TextConfig's `sliding_window`


@dataclass(frozen=True)
class GemmaConfig:
    layer_types: tuple[str, ...]  # FULL or SLIDING, one per layer
    window: int | None  # the sliding layers' window; None where it covers the served context
    scale: float | None  # query_pre_attn_scalar ** -0.5; None where it is 1 / sqrt(head_dim)
    attn_softcap: float | None  # Gemma 2's scores -> cap * tanh(scores / cap)
    final_softcap: float | None  # the logits' cap
    qk_norm: bool  # Gemma 3: q and k RMS-normed per head
    local_theta: float  # the sliding layers' rope base (Gemma 2: the global one)
    local_scaling: dict[str, Any] | None

    def sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING


def gemma_config(cfg: ModelConfig) -> GemmaConfig:
    """`cfg`'s Gemma keys, checked; raises UnsupportedModelError naming the key it refuses."""
    raw = cfg.raw
    gemma3 = cfg.architecture == GEMMA3
    # transformers reads `hidden_activation` (a 4.x `hidden_act` beside it is not used).
    act = raw.get("hidden_activation") or GELU_TANH
    if act != GELU_TANH:
        raise UnsupportedModelError(
            f"hidden_activation={act!r} is not supported (only {GELU_TANH!r})"
        )
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=true is not supported")
    # Gemma2Config alternates whatever the config says; Gemma 3 reads 4.x's pattern key.
    pattern = int(raw.get("sliding_window_pattern", 6)) if gemma3 else 2
    layer_types = _layer_types(cfg, pattern)
    # Absent: the config classes' default; null: no window, which sliding layers cannot use.
    window = raw.get("sliding_window", DEFAULT_WINDOW)
    if SLIDING in layer_types and (window is None or int(window) < 1):
        raise UnsupportedModelError(f"sliding_window={window!r}: the sliding layers need one")
    window = None if window is None else int(window)
    if window is not None and window >= cfg.max_model_len:
        window = None  # every key the layer could see is in its window: full attention
    scalar = float(raw.get("query_pre_attn_scalar", 256))
    scale = scalar**-0.5
    # Gemma 3 keeps `attn_logit_softcapping` in its config but transformers never applies it.
    attn_cap = None if gemma3 else raw.get("attn_logit_softcapping", 50.0)
    final_cap = raw.get("final_logit_softcapping", None if gemma3 else 30.0)
    local_theta, local_scaling = _local_rope(raw) if gemma3 else (cfg.rope_theta, cfg.rope_scaling)
    return GemmaConfig(
        layer_types=layer_types,
        window=window,
        scale=None if scale == cfg.head_dim**-0.5 else scale,
        attn_softcap=None if attn_cap is None else float(attn_cap),
        final_softcap=None if final_cap is None else float(final_cap),
        qk_norm=gemma3,
        local_theta=local_theta,
        local_scaling=local_scaling,
    )


def _layer_types(cfg: ModelConfig, pattern: int) -> tuple[str, ...]:
    """config.json's `layer_types`, else transformers' default: every `pattern`-th layer full,
    the others sliding."""
    if not cfg.layer_types:
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_layers))
    unknown = sorted(set(cfg.layer_types) - {FULL, SLIDING})
    if unknown or len(cfg.layer_types) != cfg.num_layers:
        raise UnsupportedModelError(
            f"layer_types={list(cfg.layer_types)} is not supported: {cfg.num_layers} entries of "
            f"{FULL!r} or {SLIDING!r} expected"
        )
    return cfg.layer_types


def _local_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's sliding layers' (rope base, scaling): transformers 5's
    `rope_parameters.sliding_attention`, else 4.x's `rope_local_base_freq` (unscaled)."""
    params = (raw.get("rope_parameters") or {}).get(SLIDING)
    if params is None:
        return float(raw.get("rope_local_base_freq", LOCAL_THETA)), None
    scaling = dict(params)
    theta = float(scaling.pop("rope_theta", raw.get("rope_local_base_freq", LOCAL_THETA)))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_parameters.{SLIDING}.rope_type={rope_type!r} is not supported; "
            f"supported: {SUPPORTED_ROPE_TYPES}"
        )
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **scaling}
