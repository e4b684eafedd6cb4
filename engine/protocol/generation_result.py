"""GenerationResult: one completion of `LLMEngine.generate`, accumulated from step outputs
(engine/core/generate.py steps the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from engine.protocol.messages import FinishReason, PromptLogprobs, RequestOutput

T = TypeVar("T")


@dataclass
class GenerationResult:
    """One completion (one index of one prompt) from `LLMEngine.generate`."""

    prompt_token_ids: list[int]
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    policy_versions: list[int] = field(default_factory=list)  # one per token
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # index 0, when asked for
    sampling_support: list[list[int]] | None = None  # one per token, when asked for
    routed_experts: list[list[int]] | None = None  # one per token ([MoE layer, k]), when asked

    def add(self, out: RequestOutput) -> None:
        """Fold in one step's output for this completion (the last one sets finish_reason).
        Linear in the output's tokens: the lists grow in place, never copied per token."""
        self.token_ids.extend(out.new_token_ids)
        self.policy_versions.extend([out.policy_version] * len(out.new_token_ids))
        if out.logprobs is not None:
            self.logprobs = _extended(self.logprobs, out.logprobs)
        if out.top_logprobs is not None:
            self.top_logprobs = _extended(self.top_logprobs, out.top_logprobs)
        if out.sampling_support is not None:
            self.sampling_support = _extended(self.sampling_support, out.sampling_support)
        if out.routed_experts is not None:
            self.routed_experts = _extended(self.routed_experts, out.routed_experts)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error


def _extended(values: list[T] | None, more: list[T]) -> list[T]:
    """`values` extended in place by `more` (a new list the first time)."""
    if values is None:
        return list(more)
    values.extend(more)
    return values
