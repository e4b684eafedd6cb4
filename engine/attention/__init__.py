"""Attention backends and the choice between them.

`backend` (AttentionBackend: what a model's attention layers call; KVCache, one layer's pages),
`metadata` (a step's AttentionMetadata). `torch_ref` runs anywhere and is the correctness
reference; `triton` (paged kernels) is the fast path on CUDA; `cpu` is torch_ref with decode
attention in a C kernel of its own, built on first use with the system's C compiler
(engine/attention/cpu_kernels.py). `auto` picks triton on CUDA when it can be imported; on the
CPU, cpu for float32 and bfloat16 when the kernel builds; torch_ref elsewhere.

May import: engine.layers
"""

from __future__ import annotations

import torch

from engine.attention import cpu_kernels
from engine.attention.backend import AttentionBackend, KVCache, LayerAttention
from engine.attention.cpu_paged import CpuPagedAttention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchRefAttention
from engine.layers.kernel_choice import triton_available

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuPagedAttention",
    "KVCache",
    "LayerAttention",
    "TorchRefAttention",
    "make_backend",
    "resolve_backend",
    "triton_available",
]


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `name` ("auto", "torch_ref", "triton", "cpu") means on this device."""
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch_ref"
        cpu_ok = device.type == "cpu" and dtype in cpu_kernels.DTYPES
        return "cpu" if cpu_ok and cpu_kernels.load() is not None else "torch_ref"
    if name == "triton" and not triton_available():
        raise ValueError("attention_backend: triton is not installed (pip install triton)")
    if name == "cpu":
        if device.type != "cpu" or dtype not in cpu_kernels.DTYPES:
            raise ValueError("attention_backend: cpu runs float32 and bfloat16 on the CPU only")
        if cpu_kernels.load() is None:
            raise ValueError("attention_backend: cpu needs a C compiler (cc, or $CC) to build")
    return name


def make_backend(
    name: str, device: torch.device, scale: float, page_size: int, dtype: torch.dtype
) -> AttentionBackend:
    """The attention backend for this device and dtype. Forcing triton on the CPU works only
    under Triton's interpreter (TRITON_INTERPRET=1), which the tests use."""
    resolved = resolve_backend(name, device, dtype)
    if resolved == "torch_ref":
        return TorchRefAttention(scale, page_size)
    if resolved == "cpu":
        lib = cpu_kernels.load()
        assert lib is not None  # resolve_backend checked
        return CpuPagedAttention(scale, page_size, lib)
    from engine.attention.triton_paged import TritonPagedAttention, interpreting

    if device.type != "cuda" and not interpreting():
        raise ValueError(
            "attention_backend: triton needs CUDA (on the CPU only under TRITON_INTERPRET=1)"
        )
    programs = 16  # the interpreter on the CPU: few programs, still more than one split
    if device.type == "cuda":
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return TritonPagedAttention(scale, page_size, num_programs=programs)
