"""Rotary position embeddings as transformers computes them (default, linear, llama3, and
Gemma 4's proportional rope, which rotates only part of each head)."""

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
    if scaling["rope_type"] == "proportional":
        fraction = float(scaling.get("partial_rotary_factor", 1.0))
        return proportional_inverse_frequencies(
            head_dim, theta, fraction, float(scaling.get("factor", 1.0))
        )
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


def proportional_inverse_frequencies(
    head_dim: int, theta: float, fraction: float, factor: float = 1.0
) -> torch.Tensor:  # [head_dim // 2] float32
    """Proportional rope (Gemma 4's global layers): the first `fraction` of each half-head's
    angles rotate, at the frequencies a full head would give them (exponents over head_dim, not
    over the rotated width); the other angles have frequency 0.

    A zero frequency makes cos 1 and sin 0, so the full-head rotation (x * cos +
    rotate_half(x) * sin, pairing dim i with i + head_dim / 2) leaves those dims exactly as they
    are: every backend's rotary kernel computes partial rotation from these tables unchanged.
    """
    angles = int(fraction * head_dim // 2)  # transformers' int(fraction * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float) / head_dim
    rotated = 1.0 / (theta**exponents)
    still = torch.zeros(head_dim // 2 - angles, dtype=torch.float32)
    return torch.cat((rotated, still)) / factor


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_len, indexed by each token's position."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

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
