"""Triton kernels in tests: compiled on CUDA, else run on the CPU by Triton's interpreter.

NOTE: the interpreter is chosen when triton is first imported (its own library functions are
jitted then), so a test module of kernels calls `use_triton` at collection, before anything
imports triton; TRITON_INTERPRET then stays set for the session (on the CPU only Sluice's
kernels import triton).
"""

from __future__ import annotations

import os
import sys

import pytest


def use_triton(device: str) -> None:
    """Make triton usable on `device` ("cuda" or "cpu"), or skip the calling test module."""
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip(
                "triton was imported before the interpreter was chosen", allow_module_level=True
            )
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
