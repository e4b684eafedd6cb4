"""engine/layers/rope.py's tables and rotation equal transformers' own (5.23) for LongRoPE and a
partial rotary: Phi3RotaryEmbedding's cos/sin (with its per-call choice of short or long
factors) and Phi-3's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from engine.layers.rope import RotaryEmbedding
from engine.models.hf_config import parse_model_config

ORIGINAL = 64


def phi3_config(partial: float, **rope: object) -> Phi3Config:
    dim = int(16 * partial)  # hidden 64 over 4 heads
    return Phi3Config(
        vocab_size=32,
        pad_token_id=None,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(dim // 2)],
            "long_factor": [2.0 + 0.7 * i for i in range(dim // 2)],
            **rope,
        },
    )


def ours(config: Phi3Config, served: int) -> RotaryEmbedding:
    raw = config.to_dict() | {"architectures": ["Phi3ForCausalLM"]}
    cfg = parse_model_config(raw, {}, served)
    rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    return RotaryEmbedding(cfg.head_dim, served, cfg.rope_theta, cfg.rope_scaling, rotary_dim)


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize(("served", "seq_len"), [(ORIGINAL, 40), (256, 200)])
def test_longrope_tables_equal_transformers_for_a_sequence_the_served_context_matches(
    partial: float, served: int, seq_len: int
) -> None:
    """A served context within the original length: transformers' short factors for every
    sequence; beyond it: its long factors, which it uses for sequences past the original."""
    config = phi3_config(partial)
    hf = Phi3RotaryEmbedding(config)
    positions = torch.arange(seq_len)
    x = torch.zeros(1, seq_len, 64)
    cos, sin = hf(x, positions[None])
    rotary = ours(config, served)
    assert torch.equal(rotary.cos[:seq_len], cos[0])
    assert torch.equal(rotary.sin[:seq_len], sin[0])
    assert hf.attention_scaling != 1.0  # factor 4: sqrt(1 + ln 4 / ln 64)


def test_an_explicit_attention_factor_scales_the_tables() -> None:
    config = phi3_config(1.0, attention_factor=1.5)
    cos, _ = Phi3RotaryEmbedding(config)(torch.zeros(1, 8, 64), torch.arange(8)[None])
    assert torch.equal(ours(config, ORIGINAL).cos[:8], cos[0])
    assert ours(config, ORIGINAL).cos[0, 0] == 1.5


def test_a_partial_rotary_equals_transformers_apply_rotary_pos_emb() -> None:
    config = phi3_config(0.75)
    rotary = ours(config, 256)
    positions = torch.arange(100, 180)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, 16, generator=gen)
    k = torch.randn(len(positions), 2, 16, generator=gen)
    got_q, got_k = rotary(positions, q, k)
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    # transformers' layout: [batch, heads, tokens, head_dim]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., 12:], q[..., 12:])  # the last quarter passes through
