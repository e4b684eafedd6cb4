"""Triton kernels in tests: compiled on CUDA, else run on the CPU by Triton's interpreter.

NOTE: the interpreter is chosen when triton is first imported (its own library functions are
jitted then), so a test module of kernels calls `use_triton` at collection, before anything
imports triton; TRITON_INTERPRET then stays set for the session (on the CPU only Sluice's
kernels import triton).
"""

from __future__ import annotations

import os
import sys
from typing import Any

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
    if device == "cpu":
        patch_the_language_once_per_launch()


def patch_the_language_once_per_launch() -> None:
    """Make the interpreter's calls of `@triton.jit` helpers inside a kernel skip re-patching
    `triton.language` modules that the launch in progress has already patched.

    Why: the interpreter (triton 3.9) patches the language (`_patch_lang`: `inspect.getmembers`
    over `tl`, `tl.tensor`, `tl.math`, then re-set wrappers) at each launch, and again at every
    call of a jitted helper (`tl.sum`, `tl.max`, our own) inside the kernel: thousands of times a
    launch. Within a launch the repeat changes nothing: what was patched is no longer a builtin,
    so it finds nothing left to wrap and re-sets equivalent wrappers. A helper whose module sees
    a language module not yet patched in this launch (`tl.core`, for the standard library) still
    gets the original call, as does any call outside a launch. It was 55-60% of the fused
    sampler's tests' CPU time. Left alone on any other triton layout.
    """
    from triton import language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or hasattr(interpreter, "sluice_patched_once"):
        return
    interpreter.sluice_patched_once = True  # type: ignore[attr-defined]
    launch: dict[str, Any] = {"state": None, "patched": set()}
    run_grid = executor.__call__

    def launch_grid(self: Any, *args: Any, **kwargs: Any) -> Any:
        launch["state"], launch["patched"] = "starting", set()
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launch["state"], launch["patched"] = None, set()

    def patch_lang(fn: Any) -> Any:
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if launch["state"] == "running" and langs <= launch["patched"]:
            return interpreter._LangPatchScope()  # a helper's call: its return value is unused
        if launch["state"] is not None:  # first the launch's own patch, which it restores
            launch["state"] = "running"
            launch["patched"] |= langs
        return original(fn)

    executor.__call__ = launch_grid
    interpreter._patch_lang = patch_lang
