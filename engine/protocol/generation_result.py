"""GenerationResult: one completion of `LLMEngine.generate`, accumulated from step outputs;
`generate`, which steps an engine until every completion of a batch of prompts has ended."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from engine.protocol.messages import FinishReason, PromptLogprobs, RequestOutput, SamplingParams

T = TypeVar("T")


class Engine(Protocol):
    """What `generate` uses of LLMEngine."""

    _arrivals: itertools.count[int]

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, n: int
    ) -> None: ...

    def step(self) -> Sequence[RequestOutput]: ...

    def wait_for_grammars(self) -> None: ...


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


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    n: int = 1,
) -> list[GenerationResult]:
    """LLMEngine.generate: add the prompts, step until each of their completions has ended
    (outputs of other callers' requests are skipped); results in prompt order, n per prompt."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    results: dict[tuple[str, int], GenerationResult] = {}
    ids = []
    for k, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        request_id = f"generate-{next(engine._arrivals)}-{k}"
        ids.append(request_id)
        for index in range(n):
            results[(request_id, index)] = GenerationResult(list(prompt), index)
        engine.add_request(request_id, prompt, p, n=n)
    remaining = len(results)
    while remaining:
        for out in engine.step():
            result = results.get((out.request_id, out.index))
            if result is None:
                continue
            result.add(out)
            remaining -= out.finished
        engine.wait_for_grammars()  # rather than spin while they compile
    return [results[(rid, i)] for rid in ids for i in range(n)]
