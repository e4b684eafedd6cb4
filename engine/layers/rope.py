"""Rotary position embeddings as transformers computes them (default, linear, llama3, longrope,
yarn, and Gemma 4's proportional rope), over the whole head or, with a partial rotary
(Phi-4-mini), its first `rotary_dim` dimensions.

LongRoPE and YaRN also scale cos and sin by their attention factor, as transformers does: the
tables hold the scaled values, so every backend that reads them (torch_ref's `rotary`, the C
rotary_store, the Triton rotary_kv kernel) applies it. The rotation is the rotate-half layout
(first half of a head against its second half), which is also the layout gpt-oss's
`_apply_rotary_emb` uses.
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


def longrope_frequencies(
    dim: int, theta: float, scaling: dict[str, Any], max_len: int
) -> tuple[torch.Tensor, float]:  # ([dim // 2] float32, attention factor)
    """LongRoPE (Phi-3/Phi-4): each frequency divided by its own factor, from `long_factor`
    when the served context `max_len` exceeds `original_max_position_embeddings`, else from
    `short_factor`; cos and sin scaled by the attention factor (`attention_factor`, else
    sqrt(1 + ln(factor) / ln(original)) when `factor` > 1).

    NOTE: transformers picks the factors per forward call, by that call's longest position, so
    a sequence crossing the original length mixes them in its cache; a served context picks
    once, as vLLM does: equal to transformers for every sequence when the served context is
    within the original length, and for sequences longer than it otherwise.
    """
    original = int(scaling["original_max_position_embeddings"])
    factors = scaling["long_factor"] if max_len > original else scaling["short_factor"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = float(scaling["factor"])
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention)


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
    """cos/sin tables for every position up to max_len, indexed by each token's position.

    `rotary_dim` (default: the whole head) is how many leading dimensions of each head rotate
    (transformers' `partial_rotary_factor` times head_dim); the rest pass through unchanged.
    The tables are [max_len, rotary_dim] float32, already scaled by the rope type's attention
    factor (LongRoPE's, YaRN's)."""

    def __init__(
        self,
        head_dim: int,
        max_len: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        attention = 1.0
        if scaling is not None and scaling["rope_type"] == "longrope":
            inv_freq, attention = longrope_frequencies(self.rotary_dim, theta, scaling, max_len)
        elif scaling is not None and scaling["rope_type"] == "yarn":
            inv_freq, attention = yarn(self.rotary_dim, theta, scaling)
        else:
            inv_freq = inverse_frequencies(self.rotary_dim, theta, scaling)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, rotary_dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos() * attention, persistent=False)
        self.register_buffer("sin", emb.sin() * attention, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [tokens]; q [tokens, heads, head_dim]; k [tokens, kv_heads, head_dim]
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]  # a partial rotary: the rest passes through
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
