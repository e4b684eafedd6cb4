"""What the Triton attention kernels share: a layer's scores in log2 units, and the compile-time
constants a layer kind becomes.

The kernels run their softmax in base 2 (`tl.exp2`), so every logit is multiplied by log2(e)
once: the scaled scores, capped or not, and the sinks. A layer's window, scale and cap are
constants of the model, so they reach the kernels as `tl.constexpr` (as the scale always did):
under `torch.compile` a float argument arrives as fp64 and the kernel failed to compile, and a
CUDA graph captures a launch whose constants never change. Each layer kind is its own
specialisation (a model has one or two).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from engine.attention.backend import LayerAttention

LOG2E = math.log2(math.e)


@triton.jit
def _tanh(x):
    # tl has no tanh on every Triton the project runs; from one exp2 of -2|x| (never overflows)
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def layer_scores(dots, SCORE_SCALE: tl.constexpr, CAP_LOG2: tl.constexpr):
    """q.k products -> scores in log2 units: dots * scale * log2(e), or with a soft cap c
    (CAP_LOG2 = c * log2(e) > 0; SCORE_SCALE = scale / c), c * tanh(dots * scale / c) * log2(e),
    as transformers caps them (Gemma 2)."""
    return _tanh(dots * SCORE_SCALE) * CAP_LOG2 if CAP_LOG2 > 0 else dots * SCORE_SCALE


@triton.jit
def load_sinks(sinks_ptr, heads, mask):
    """The heads' sinks (any float dtype) in log2 units, float32."""
    return tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634


def kind_constants(
    scale: float, layer: LayerAttention, sinks: torch.Tensor | None
) -> dict[str, Any]:
    """The constexpr arguments of a layer kind: SCORE_SCALE and CAP_LOG2 (see layer_scores),
    WINDOW (0: none; a query at i sees keys j with i - WINDOW < j <= i) and HAS_SINKS."""
    scale = scale if layer.scale is None else layer.scale
    cap = layer.softcap
    return {
        "SCORE_SCALE": scale * LOG2E if cap is None else scale / cap,
        "CAP_LOG2": 0.0 if cap is None else cap * LOG2E,
        "WINDOW": layer.sliding_window or 0,
        "HAS_SINKS": sinks is not None,
    }


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 along every axis


def block_n(head_dim: int, largest: int = 64) -> int:
    """Keys per iteration: `largest` up to head_dim 128, fewer above (256: half, 512: a
    quarter), so a K or V tile stays the size head_dim 128's is (registers, shared memory)."""
    return max(16, largest * 128 // max(128, block_d(head_dim)))


def dot_precision(q: torch.Tensor) -> str:
    # NOTE: float32 dots default to TF32 on tensor cores; ask for IEEE so a float32 engine
    # matches torch_ref. Half-precision inputs never use the option.
    return "ieee" if q.dtype == torch.float32 else "tf32"
