"""Prompt logprobs are bounded: scores that could pass the server's largest message are refused
from the prompt's length alone."""

from __future__ import annotations

from sluice_client import build_request

from service.rpc.admission import prompt_logprobs_violations


def test_scores_that_could_pass_the_largest_message_are_refused_before_any_work() -> None:
    request = build_request([1] * 1000, prompt_logprobs=True, top_logprobs=20)
    (violation,) = prompt_logprobs_violations(request, 1000, max_message_bytes=100_000)
    assert violation[0] == "output.prompt_logprobs"
    fewer = build_request([1] * 1000, prompt_logprobs=True, prompt_logprobs_start=600)
    assert prompt_logprobs_violations(fewer, 1000, max_message_bytes=100_000) == []
