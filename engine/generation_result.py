"""GenerationResult: one completion of `LLMEngine.generate`, accumulated from step outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import FinishReason, RequestOutput


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

    def add(self, out: RequestOutput) -> None:
        """Fold in one step's output for this completion (the last one sets finish_reason)."""
        self.token_ids += out.new_token_ids
        self.policy_versions += [out.policy_version] * len(out.new_token_ids)
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + out.top_logprobs
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error
