"""Whether the layer's Triton kernels or the torch code run: the attention backend's rule.

`auto` means triton on CUDA when it imports, torch elsewhere. Forcing triton on the CPU works
only under Triton's interpreter (TRITON_INTERPRET=1), which the tests and bench/decode.py's
kernel count use.
"""

from __future__ import annotations

import importlib.util

import torch

CHOICES = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether triton was imported under its interpreter (TRITON_INTERPRET=1)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def use_triton_kernels(name: str, device: torch.device) -> bool:
    """Whether `layer_kernels` = `name` ("auto", "torch", "triton") runs Triton on `device`."""
    if name not in CHOICES:
        raise ValueError(f"layer_kernels: expected one of {CHOICES}, got {name!r}")
    if name == "torch":
        return False
    if name == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise ValueError("layer_kernels: triton is not installed (pip install triton)")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            "layer_kernels: triton needs CUDA (on the CPU only under TRITON_INTERPRET=1)"
        )
    return True
