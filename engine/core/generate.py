"""generate: LLMEngine.generate's loop, which steps an engine until every completion of a
batch of prompts has ended, folding each output into its GenerationResult."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.protocol.generation_result import GenerationResult
from engine.protocol.messages import RequestOutput, SamplingParams

AddRequest = Callable[[str, Sequence[int], SamplingParams, int], None]


def generate(
    add_request: AddRequest,
    step: Callable[[], Sequence[RequestOutput]],
    wait_for_grammars: Callable[[], None],
    next_id: Callable[[str], str],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    n: int = 1,
) -> list[GenerationResult]:
    """LLMEngine.generate (its `add_request`, `step`, `wait_for_grammars` and a source of fresh
    ids): add the prompts, step until each of their completions has ended
    (outputs of other callers' requests are skipped); results in prompt order, n per prompt."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    results: dict[tuple[str, int], GenerationResult] = {}
    ids = []
    for k, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        request_id = f"{next_id('generate')}-{k}"
        ids.append(request_id)
        for index in range(n):
            results[(request_id, index)] = GenerationResult(list(prompt), index)
        add_request(request_id, prompt, p, n)
    remaining = len(results)
    while remaining:
        for out in step():
            result = results.get((out.request_id, out.index))
            if result is None:
                continue
            result.add(out)
            remaining -= out.finished
        wait_for_grammars()  # rather than spin while they compile
    return [results[(rid, i)] for rid in ids for i in range(n)]
