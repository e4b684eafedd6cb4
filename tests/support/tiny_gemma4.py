"""Tiny random Gemma 4 text checkpoints, written by transformers' own Gemma4TextConfig and
Gemma4ForCausalLM `save_pretrained`, with the tiny trained tokenizer beside them.

Four layers by default (sliding, full, sliding, full) so both kinds, their different head
sizes and KV head counts, and a window (8 tokens) far shorter than the prompts all appear.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.tiny_models import make_tokenizer

SLIDING, FULL = "sliding_attention", "full_attention"
BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,  # the full layers' heads: twice the sliding ones', as 512 vs 256
    "sliding_window": 8,
    "layer_types": [SLIDING, FULL, SLIDING, FULL],
    "max_position_embeddings": 512,
    "hidden_size_per_layer_input": 0,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,  # peaked enough that greedy argmax has no near-ties
}
# Shaped as the 2026 checkpoints are, at toy size: E2B/E4B (per-layer input embeddings, the
# last layers sharing KV, double-wide MLPs there), 31B (keys as values on full layers, one
# global KV head) and 26B-A4B (that, with experts beside every MLP).
CASES: dict[str, dict[str, Any]] = {
    "ple_kv_shared": {
        "num_hidden_layers": 5,
        "layer_types": [SLIDING, FULL, SLIDING, SLIDING, FULL],
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
    },
    "k_eq_v_untied": {
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "tie_word_embeddings": False,
    },
    "moe": {
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
}


def make_gemma4_checkpoint(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random Gemma4ForCausalLM checkpoint in `directory` (BASE, then `overrides`)."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    vocab = tok.get_vocab_size()
    kwargs = {"vocab_size_per_layer_input": vocab, **BASE, **overrides}
    config = transformers.Gemma4TextConfig(
        vocab_size=vocab,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=0,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)
    return directory
