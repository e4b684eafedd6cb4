"""GenerationResult folds step outputs in linear time: its lists grow in place."""

from __future__ import annotations

from engine.protocol.generation_result import GenerationResult
from engine.protocol.messages import FinishReason, RequestOutput


def one_token(token: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(
        "r",
        0,
        [token],
        3,
        [-0.5],
        [([token], [-0.5])],
        finish,
        None,
        2,
        0,
        token + 1,
        sampling_support=[[token]],
        routed_experts=[[1, 2]],
    )


def test_each_token_extends_the_same_lists_instead_of_copying_them() -> None:
    result = GenerationResult([7, 8])
    result.add(one_token(0))
    lists = [
        result.token_ids,
        result.policy_versions,
        result.logprobs,
        result.top_logprobs,
        result.sampling_support,
        result.routed_experts,
    ]
    for token in range(1, 100):
        result.add(one_token(token))
    kept = [
        result.token_ids,
        result.policy_versions,
        result.logprobs,
        result.top_logprobs,
        result.sampling_support,
        result.routed_experts,
    ]
    assert all(a is b for a, b in zip(lists, kept, strict=True)), "a list was copied"
    assert result.token_ids == list(range(100)) and result.policy_versions == [3] * 100
    assert result.logprobs == [-0.5] * 100 and result.routed_experts == [[1, 2]] * 100
    assert result.sampling_support == [[t] for t in range(100)]


def test_the_first_output_does_not_share_its_lists_with_the_result() -> None:
    out = one_token(5, FinishReason.LENGTH)
    result = GenerationResult([1])
    result.add(out)
    result.add(one_token(6))
    assert out.logprobs == [-0.5] and out.new_token_ids == [5]
    assert result.finish_reason is FinishReason.LENGTH and result.completion_tokens == 7
