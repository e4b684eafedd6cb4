"""The sampler for a device: the fused Triton kernel on CUDA, the torch reference elsewhere.

Both give the same tokens (engine/sampling/fused_sampler.py); `EngineConfig.sampler` forces either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import triton_available
from engine.sampling.sampler import Sampler, SamplerOutput, SamplingBatch

SamplerFn = Callable[[torch.Tensor, SamplingBatch], SamplerOutput]


def resolve_sampler(name: str, device: torch.device) -> str:
    """The sampler `name` ("auto", "torch", "triton") means on this device."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError("sampler: triton is not installed (pip install triton)")
    return name


def make_sampler(name: str, device: torch.device) -> SamplerFn:
    """Forcing triton on the CPU works only under Triton's interpreter (TRITON_INTERPRET=1),
    which the tests and bench/decode.py's op counts use."""
    if resolve_sampler(name, device) == "torch":
        return Sampler()
    from engine.attention.triton_paged import interpreting
    from engine.sampling.fused_sampler import FusedSampler

    if device.type != "cuda" and not interpreting():
        raise ValueError("sampler: triton needs CUDA (on the CPU only under TRITON_INTERPRET=1)")
    if device.type == "cuda":
        return FusedSampler()
    return FusedSampler(block=256)  # the interpreter: fewer, larger numpy steps
