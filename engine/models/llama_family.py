"""The Llama family's members: one row per architecture name a checkpoint's config.json gives.

Every row is built by engine/models/llama.py; the row says how the member differs from Llama
where its config.json does not say it: which projections carry a bias, whether q and k are
RMS-normed per head, and, for the mixture-of-experts members, that their sparse layers' MLP is
an MoE block (engine/moe/) and what their checkpoints name it and its experts' projections.
A new cousin (same layers, other flags) is one more row here. Stdlib only: the config reader
and the registry read it without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The experts' (gate, up, down) projections as Qwen-MoE checkpoints name them.
QWEN_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LlamaVariant:
    qkv_bias: bool | None  # q/k/v projections' bias; None: read `attention_bias` from config
    o_bias: bool | None  # o_proj's bias; None: read `attention_bias`
    qk_norm: bool  # q and k RMS-normed per head (Qwen3)
    moe: bool = False  # its sparse layers' MLP is an MoE block (MoeConfig read from config)
    moe_block: str = "mlp"  # a decoder layer's module name for its MoE block
    expert_parts: tuple[str, str, str] = QWEN_PARTS  # each expert's (gate, up, down) names
    # Which layers attend over `sliding_window` (as transformers computes them): "all"
    # (Mistral), "qwen" (`use_sliding_window`: per `layer_types`, else the layers from
    # `max_window_layers` on); "": a window is refused (hf_config.py).
    sliding: str = ""


# A registered architecture outside these rows: biases from `attention_bias`, no q/k norm, no
# experts (what a config that states its own biases reads as).
PLAIN = LlamaVariant(None, None, False)

VARIANTS = {
    "LlamaForCausalLM": LlamaVariant(None, None, False),
    "MistralForCausalLM": LlamaVariant(False, False, False, sliding="all"),
    "Qwen2ForCausalLM": LlamaVariant(True, False, False, sliding="qwen"),
    "Qwen3ForCausalLM": LlamaVariant(None, None, True, sliding="qwen"),
    "MixtralForCausalLM": LlamaVariant(
        False, False, False, moe=True, moe_block="block_sparse_moe", expert_parts=("w1", "w3", "w2")
    ),
    # qkv_bias read from `qkv_bias` (default true: engine/models/hf_config.py)
    "Qwen2MoeForCausalLM": LlamaVariant(True, False, False, moe=True),
    "Qwen3MoeForCausalLM": LlamaVariant(None, None, True, moe=True),
}


def layer_windows(
    variant: LlamaVariant, raw: dict[str, Any], served_len: int
) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) as transformers' modeling code
    applies it; empty when no layer slides over less than the served context (a window that
    long changes nothing)."""
    window = raw.get("sliding_window")
    if not variant.sliding or window is None or int(window) >= served_len:
        return ()
    layers = int(raw["num_hidden_layers"])
    if variant.sliding == "all":
        return (int(window),) * layers
    if not raw.get("use_sliding_window"):
        return ()
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", layers)) else "full"
        for i in range(layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
