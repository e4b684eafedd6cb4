"""Sluice engine: the model, the paged KV cache, the scheduler and the sampler.

Importing `engine` (or anything of `engine.protocol`) does not import torch; `LLMEngine` is
loaded on first use so that the service process can share the plain-data modules.

Each package below states what it may import of the rest; the engine as a whole imports nothing
of the service or the client (tests/test_layout.py checks every such line).
May import: nothing
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.protocol.config import EngineConfig
from engine.protocol.generation_result import GenerationResult
from engine.protocol.messages import FinishReason, PromptLogprobs, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

__all__ = [
    "EngineConfig",
    "FinishReason",
    "GenerationResult",
    "LLMEngine",
    "PromptLogprobs",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from engine.core.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
