"""The model shapes the benchmarks build random-weight checkpoints of (bench/checkpoints.py):
each a transformers architecture and its config keys, named for `--shape`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Shape:
    """One model shape: the transformers architecture and its config keys."""

    arch: str  # llama, qwen2, qwen3, qwen3_moe, gemma3_text, gpt_oss
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Gemma 3's rope: the sliding layers' local base, the full layers' global base scaled x8.
_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}

SHAPES: dict[str, Shape] = {
    # CPU shapes. `tiny` is the tests' tiny Llama with room for the nano-vllm workload.
    "tiny": Shape(
        "llama",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 320,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        "the tests' tiny Llama (GQA 4/2, 2 layers), 4096 positions",
    ),
    "small": Shape(
        "llama",
        {
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
        },
        "the demo model's size (4 layers, hidden 256), 4096 positions",
    ),
    # Against vLLM's CPU build (bench/peers/offline.py), whose CPU attention needs head_dim >= 32.
    "tiny-hd32": Shape(
        "llama",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 320,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        "0.38M parameters: tiny's vocabulary and layers at head_dim 32, 4096 positions",
    ),
    # Mixture of experts at the CPU suite's scale: `small`'s attention and layers, each MLP 8
    # experts of half `small`'s width, top-2 (the same active MLP FLOPs per token).
    "small-moe": Shape(
        "qwen3_moe",
        {
            "hidden_size": 256,
            "intermediate_size": 688,
            "moe_intermediate_size": 344,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
        },
        "Qwen3-MoE-like at small's size: 4 layers, hidden 256, 8 experts of 344, top-2",
    ),
    # Gemma-3-like at small's size: 6 layers, five sliding (window 128) to one full, q/k norms,
    # local and global rope bases (the full layers' scaled x8 as Gemma-3-4B's), head_dim 64.
    "small-gemma3": Shape(
        "gemma3_text",
        {
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 128,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
            "rope_parameters": _GEMMA3_ROPE,
            "tie_word_embeddings": True,
            "pad_token_id": None,
        },
        "Gemma-3-like at small's size: 6 layers (5 sliding of 128, 1 full), hidden 256",
    ),
    # gpt-oss-like at small's size: 4 layers alternating a 128-token window and full attention
    # (the nano-vllm workload's prompts and outputs run past it), learned sinks, YaRN as
    # gpt-oss's, 8 experts of 344 with biases and the clamped SwiGLU, top-2.
    "small-gpt-oss": Shape(
        "gpt_oss",
        {
            "hidden_size": 256,
            "intermediate_size": 344,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "sliding_window": 128,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        "gpt-oss-like at small's size: 4 layers (window 128 / full), 8 experts of 344, top-2",
    ),
    "llama-75m": Shape(
        "llama",
        {
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 8,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
        },
        "75M parameters: hidden 768, 8 layers, head_dim 64, GQA 12/4, Llama 2's vocabulary size",
    ),
    # Real shapes (the published configs, random weights).
    "qwen2.5-0.5b": Shape(
        "qwen2",
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        "Qwen2.5-0.5B",
    ),
    "qwen3-0.6b": Shape(
        "qwen3",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        "Qwen3-0.6B",
    ),
    "llama-3.2-1b": Shape(
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": _LLAMA3_ROPE,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
        "Llama-3.2-1B",
    ),
    "llama-3-8b": Shape(
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        "Meta-Llama-3-8B",
    ),
    # Gemma-3-4B's text layers (GQA 8/4, head_dim 256, window 1024, linear rope x8 on the full
    # layers) with 6 of its 34 layers: five sliding, one full, as its pattern repeats.
    "gemma-3-4b-6l": Shape(
        "gemma3_text",
        {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 1024,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
            "rope_parameters": _GEMMA3_ROPE,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "pad_token_id": None,
        },
        "Gemma-3-4B (text) with 6 of its 34 layers",
    ),
    # Qwen3-30B-A3B's layer (128 experts of 768, top-8, GQA 32/4, head_dim 128) with 4 of its 48
    # layers, so a timed GPU run builds and loads it in seconds.
    "qwen3-30b-a3b-4l": Shape(
        "qwen3_moe",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "num_hidden_layers": 4,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        "Qwen3-30B-A3B with 4 of its 48 layers",
    ),
    # gpt-oss-20b's layer (32 experts of 2880 with biases, top-4, GQA 64/8, head_dim 64, sinks,
    # YaRN x32 over 4096) with 4 of its 24 layers (two sliding of 128, two full), unquantized:
    # about 4.4B parameters, 8.7 GB in bfloat16 (1.2B of them the embedding and LM head).
    "gpt-oss-20b-4l": Shape(
        "gpt_oss",
        {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 4,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "sliding_window": 128,
            "vocab_size": 201088,
            "max_position_embeddings": 131072,
            "rope_theta": 150000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        "gpt-oss-20b with 4 of its 24 layers, experts in bfloat16 (not MXFP4)",
    ),
}
