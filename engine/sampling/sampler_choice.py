"""The sampler for a device: the fused Triton kernel on CUDA, the torch reference elsewhere.

Both give the same tokens (engine/sampling/fused_sampler.py); `EngineConfig.sampler` forces either.
A step asking for SAMPLED logprobs or the sampling support, or for raw logprobs with a sampling
surface, runs the torch one (FusedOrTorch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.layers.kernel_choice import interpreting, triton_available
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
    from engine.sampling.fused_sampler import FusedSampler

    if device.type != "cuda" and not interpreting():
        raise ValueError("sampler: triton needs CUDA (on the CPU only under TRITON_INTERPRET=1)")
    fused = FusedSampler() if device.type == "cuda" else FusedSampler(block=256)  # interpreter:
    # fewer, larger numpy steps
    return FusedOrTorch(fused, Sampler())


class FusedOrTorch:
    """The fused kernels, except for a batch asking what only the torch sampler computes (SAMPLED
    logprobs, the sampling support, raw logprobs beside a sampling surface): the two pick the same tokens, so a request's tokens do not
    depend on which one a step ran."""

    def __init__(self, fused: SamplerFn, torch_sampler: Sampler) -> None:
        self.fused = fused
        self.torch_sampler = torch_sampler

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw_beside_surface = batch.raw_logprobs and batch.has_surface
        if batch.sampled_logprobs or batch.support_width or raw_beside_surface:
            return self.torch_sampler(logits, batch)
        return self.fused(logits, batch)
