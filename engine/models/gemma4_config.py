"""Gemma 4 (text) as its config.json describes it: each layer's attention, the rope of each layer
kind, which layers share another's KV, the per-layer input embeddings and the experts.

Read with transformers 5.23's Gemma4TextConfig keys and defaults. Its layers differ: a
`layer_types` entry says sliding window or full; full layers have their own head size
(`global_head_dim`, 512 by default) and, with `attention_k_eq_v`, their own KV head count
(`num_global_key_value_heads`) and no v_proj (the keys, before their norm and rope, are the
values). transformers 5.23 writes these as `per_layer_config` ({layer index: {"head_dim",
"num_key_value_heads"}}); older checkpoints as the two global keys, which transformers turns
into the same overrides. Both are read. The last `num_kv_shared_layers` layers compute no K or
V: each reads the KV of the last earlier layer of its kind (transformers' `kv_sharing_modes`).

Anything else Gemma 4 can say that this engine does not compute is refused by name
(UnsupportedModelError). Stdlib only (and MoeConfig): the config reader imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.moe.config import MoeConfig

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "proportional")
LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what per_layer_config may set


class UnsupportedGemma4Error(ValueError):
    """A Gemma 4 config value this engine does not compute (hf_config re-raises it as
    UnsupportedModelError)."""


@dataclass(frozen=True)
class Gemma4Layer:
    """One decoder layer's attention and feed-forward, as the checkpoint says (whole model,
    before any tensor-parallel split)."""

    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    sliding_window: int | None  # None: the whole context
    k_eq_v: bool  # no v_proj: the values are the keys before their norm and rope
    kv_source: int  # the layer whose K and V it attends to: itself, unless it shares
    double_wide_mlp: bool  # its MLP is twice intermediate_size wide

    @property
    def owns_kv(self) -> bool:
        return self.kv_source < 0


@dataclass(frozen=True)
class Rope:
    """One layer kind's rope: its base, and for proportional rope the rotated fraction."""

    theta: float
    scaling: dict[str, Any] | None  # None: default rope; else RotaryEmbedding's scaling dict


@dataclass(frozen=True)
class Gemma4Config:
    layers: tuple[Gemma4Layer, ...]
    rope: dict[str, Rope]  # by layer kind
    final_logit_softcapping: float | None
    per_layer_input_size: int  # hidden_size_per_layer_input; 0: no per-layer embeddings
    per_layer_vocab_size: int  # vocab_size_per_layer_input
    attention_bias: bool
    moe: MoeConfig | None  # every layer's experts (beside its dense MLP), or None

    @property
    def cache_layers(self) -> list[int]:
        """The layers that hold a KV cache, in order (the sharing layers hold none)."""
        return [i for i, layer in enumerate(self.layers) if layer.owns_kv]


def parse_gemma4(raw: dict[str, Any]) -> Gemma4Config:
    """The Gemma 4 text config of a config.json; UnsupportedGemma4Error names any key whose
    value this engine does not compute."""
    _refuse_unsupported(raw)
    kinds = _layer_types(raw)
    overrides = _per_layer_overrides(raw, kinds)
    window = int(raw.get("sliding_window", 512))
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    shared = int(raw.get("num_kv_shared_layers", 0))
    first_shared = len(kinds) - shared
    if not 0 <= shared < len(kinds) or set(kinds[first_shared:]) - set(kinds[:first_shared]):
        raise UnsupportedGemma4Error(
            f"num_kv_shared_layers={shared}: every sharing layer needs an earlier layer of its "
            "kind to read K and V from"
        )
    double_wide = bool(raw.get("use_double_wide_mlp", False))
    layers = []
    for i, kind in enumerate(kinds):
        own = overrides.get(i, {})
        source = -1
        if i >= first_shared:  # the last non-sharing layer of its kind
            source = max(j for j in range(first_shared) if kinds[j] == kind)
        layers.append(
            Gemma4Layer(
                kind=kind,
                head_dim=int(own.get("head_dim", raw.get("head_dim", 256))),
                num_kv_heads=int(own.get("num_key_value_heads", raw.get("num_key_value_heads", 4))),
                sliding_window=window if kind == SLIDING else None,
                k_eq_v=k_eq_v and kind == FULL,
                kv_source=source,
                double_wide_mlp=double_wide and source >= 0,
            )
        )
    _check_uniform_kinds(layers)
    softcap = raw.get("final_logit_softcapping")
    return Gemma4Config(
        layers=tuple(layers),
        rope={kind: _rope(raw, kind) for kind in sorted(set(kinds))},
        final_logit_softcapping=None if softcap is None else float(softcap),
        per_layer_input_size=int(raw.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab_size=int(raw.get("vocab_size_per_layer_input", 262_144)),
        attention_bias=bool(raw.get("attention_bias", False)),
        moe=gemma4_moe(raw),
    )


def gemma4_moe(raw: dict[str, Any]) -> MoeConfig | None:
    """Every layer's experts when `enable_moe_block` (routing as Gemma4TextRouter: softmax in
    float32, top-k renormalised, then scaled per expert; weights kept in float32)."""
    if not raw.get("enable_moe_block", False):
        return None
    experts, top_k = int(raw.get("num_experts") or 0), int(raw.get("top_k_experts") or 0)
    if not 1 <= top_k <= experts:
        raise UnsupportedGemma4Error(
            f"top_k_experts={top_k} must be within 1..num_experts={experts}"
        )
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=True,
        weights_in_float32=True,
        shared_expert_intermediate_size=0,
        sparse_layers=tuple(range(int(raw["num_hidden_layers"]))),
    )


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    if raw.get("use_bidirectional_attention") is not None:
        value = raw["use_bidirectional_attention"]
        raise UnsupportedGemma4Error(
            f"use_bidirectional_attention={value!r} is not supported (causal attention only)"
        )
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedGemma4Error(
            f"hidden_activation={act!r} is not supported (only 'gelu_pytorch_tanh')"
        )
    for key in ("vision_config", "audio_config"):
        if raw.get(key) is not None:
            raise UnsupportedGemma4Error(f"{key}: Gemma 4's vision and audio parts are not served")
    ple = int(raw.get("hidden_size_per_layer_input") or 0)
    ple_vocab = int(raw.get("vocab_size_per_layer_input", 262_144))
    if ple and ple_vocab < int(raw["vocab_size"]):
        raise UnsupportedGemma4Error(
            f"vocab_size_per_layer_input={ple_vocab} is smaller than vocab_size="
            f"{raw['vocab_size']}: some tokens would have no per-layer embedding"
        )


def _layer_types(raw: dict[str, Any]) -> list[str]:
    """`layer_types`, or transformers' default (five sliding layers to one full); the last
    layer is always full (transformers forces it, with a warning)."""
    count = int(raw["num_hidden_layers"])
    kinds = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(count)])
    if len(kinds) != count:
        raise UnsupportedGemma4Error(
            f"layer_types has {len(kinds)} entries for num_hidden_layers={count}"
        )
    for kind in kinds:
        if kind not in (SLIDING, FULL):
            raise UnsupportedGemma4Error(
                f"layer_types entry {kind!r} is not supported ({SLIDING!r} or {FULL!r})"
            )
    kinds[-1] = FULL
    return kinds


def _per_layer_overrides(raw: dict[str, Any], kinds: list[str]) -> dict[int, dict[str, Any]]:
    """Each layer's head_dim / num_key_value_heads where they differ from the global ones."""
    given = raw.get("per_layer_config")
    if given is None:  # the older keys, as Gemma4TextConfig turns them into overrides
        full: dict[str, Any] = {"head_dim": int(raw.get("global_head_dim", 512))}
        global_kv = raw.get("num_global_key_value_heads")
        if global_kv is not None and raw.get("attention_k_eq_v", True):
            full["num_key_value_heads"] = int(global_kv)
        return {i: full for i, kind in enumerate(kinds) if kind == FULL}
    overrides: dict[int, dict[str, Any]] = {}
    for index, values in given.items():
        unknown = sorted(set(values) - set(LAYER_OVERRIDES))
        if unknown:
            raise UnsupportedGemma4Error(
                f"per_layer_config.{index}.{unknown[0]} is not supported "
                f"(only {', '.join(LAYER_OVERRIDES)})"
            )
        if not 0 <= int(index) < len(kinds):
            raise UnsupportedGemma4Error(f"per_layer_config.{index}: no such layer")
        overrides[int(index)] = dict(values)
    return overrides


def _check_uniform_kinds(layers: list[Gemma4Layer]) -> None:
    """One head size and KV head count per layer kind: a kind's rope table is built for one
    head size, and a sharing layer reads K and V shaped by its source."""
    for kind in (SLIDING, FULL):
        shapes = {(layer.head_dim, layer.num_kv_heads) for layer in layers if layer.kind == kind}
        if len(shapes) > 1:
            raise UnsupportedGemma4Error(
                f"per_layer_config: {kind} layers of different head_dim / num_key_value_heads "
                f"{sorted(shapes)} are not supported"
            )


def _rope(raw: dict[str, Any], kind: str) -> Rope:
    params = (raw.get("rope_parameters") or {}).get(kind)
    if params is None:  # transformers' defaults
        params = {"rope_type": "default", "rope_theta": 10_000.0}
        if kind == FULL:
            params = {"rope_type": "proportional", "partial_rotary_factor": 0.25}
            params["rope_theta"] = 1_000_000.0
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedGemma4Error(
            f"rope_parameters.{kind}.rope_type={rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    theta = float(params["rope_theta"])
    if rope_type == "default":  # Gemma 4's default rope reads rope_theta alone
        return Rope(theta, None)
    scaling = {
        "rope_type": "proportional",
        "partial_rotary_factor": float(params.get("partial_rotary_factor", 1.0)),
        "factor": float(params.get("factor", 1.0)),
    }
    return Rope(theta, scaling)
