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


# A registered architecture outside these rows: biases from `attention_bias`, no q/k norm, no
# experts (what a config that states its own biases reads as).
PLAIN = LlamaVariant(None, None, False)

VARIANTS = {
    "LlamaForCausalLM": LlamaVariant(None, None, False),
    "MistralForCausalLM": LlamaVariant(False, False, False),
    "Qwen2ForCausalLM": LlamaVariant(True, False, False),
    "Qwen3ForCausalLM": LlamaVariant(None, None, True),
    "MixtralForCausalLM": LlamaVariant(
        False, False, False, moe=True, moe_block="block_sparse_moe", expert_parts=("w1", "w3", "w2")
    ),
    # qkv_bias read from `qkv_bias` (default true: engine/models/hf_config.py)
    "Qwen2MoeForCausalLM": LlamaVariant(True, False, False, moe=True),
    "Qwen3MoeForCausalLM": LlamaVariant(None, None, True, moe=True),
}
