"""Rotary position embeddings as transformers computes them (default, linear, llama3, yarn).

YaRN (gpt-oss) also scales cos and sin by its attention factor, as transformers does: the
tables hold the scaled values, so every backend that reads them (torch_ref's `rotary`, the
Triton rotary_kv kernel) applies it. The rotation is the rotate-half layout (first half of a
head against its second half), which is also the layout gpt-oss's `_apply_rotary_emb` uses.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def yarn(
    head_dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:  # ([head_dim // 2] float32, attention factor)
    """YaRN's inverse frequencies and attention factor, as transformers'
    `_compute_yarn_parameters`: interpolated (divided by `factor`) below the correction range,
    extrapolated (kept) above it, a linear ramp between. The config reader fills
    `original_max_position_embeddings` and a missing `factor` (engine/models/hf_config.py)."""
    factor = float(scaling["factor"])
    old_len = scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation = 1 - torch.clamp(ramp, 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_len, indexed by each token's position (YaRN:
    scaled by its attention factor)."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        attention = 1.0
        if scaling is not None and scaling["rope_type"] == "yarn":
            inv_freq, attention = yarn(head_dim, theta, scaling)
        else:
            inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [tokens]; q [tokens, heads, head_dim]; k [tokens, kv_heads, head_dim]
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
