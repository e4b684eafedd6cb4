"""Attention backends and the choice between them.

`torch_ref` runs anywhere and is the correctness reference; `triton` (paged kernels) is the
fast path on CUDA. `auto` picks triton on CUDA when it can be imported, torch_ref elsewhere.
May import `engine.layers` (the Triton backend's rotary and KV-write kernel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchRefAttention
from engine.layers.kernel_choice import triton_available

if TYPE_CHECKING:
    from engine.models.llama import AttentionBackend

__all__ = [
    "AttentionMetadata",
    "TorchRefAttention",
    "make_backend",
    "resolve_backend",
    "triton_available",
]


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend `name` ("auto", "torch_ref", "triton") means on this device."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch_ref"
    if name == "triton" and not triton_available():
        raise ValueError("attention_backend: triton is not installed (pip install triton)")
    return name


def make_backend(name: str, device: torch.device, scale: float, page_size: int) -> AttentionBackend:
    """The attention backend for this device. Forcing triton on the CPU works only under
    Triton's interpreter (TRITON_INTERPRET=1), which the tests use."""
    resolved = resolve_backend(name, device)
    if resolved == "torch_ref":
        return TorchRefAttention(scale, page_size)
    from engine.attention.triton_paged import TritonPagedAttention, interpreting

    if device.type != "cuda" and not interpreting():
        raise ValueError(
            "attention_backend: triton needs CUDA (on the CPU only under TRITON_INTERPRET=1)"
        )
    programs = 16  # the interpreter on the CPU: few programs, still more than one split
    if device.type == "cuda":
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return TritonPagedAttention(scale, page_size, num_programs=programs)
