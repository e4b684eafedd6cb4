"""The request rules both processes apply (engine/protocol/validation/request_rules.py): each
rule's boundary, and the engine's ERROR and the service's INVALID_ARGUMENT giving one reason."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from sluice_client import build_request

from engine.protocol.messages import ModelInfo, SamplingParams
from engine.protocol.validation.request_rules import (
    RequestLimits,
    empty_prompt,
    newer_than_served,
    no_experts,
    no_room,
    not_loaded,
    outside_vocabulary,
    request_error,
    samples_of_a_score,
    samples_out_of_range,
    scores_past_the_prompt,
)
from service.rpc.admission import field_violations

INFO = ModelInfo("m", "/m", "LlamaForCausalLM", 16, 100, [2], "cpu", "float32", 4, 64, 0, 4)
LIMITS = RequestLimits.of(INFO)


def test_limits_are_read_from_the_model_info() -> None:
    assert RequestLimits(vocab_size=100, max_model_len=16, max_num_seqs=4, moe=False) == LIMITS
    assert RequestLimits.of(replace(INFO, moe_layers=2)).moe


def test_each_rule_keeps_its_boundary() -> None:
    assert empty_prompt(1) is None and empty_prompt(0) == "must not be empty"
    assert no_room(15, 16) is None and no_room(16, 16) is not None
    assert outside_vocabulary([0, 99], 100) is None
    assert outside_vocabulary([100], 100) and outside_vocabulary([-1], 100)
    assert samples_out_of_range(4, 4) is None
    assert samples_out_of_range(0, 4) and samples_out_of_range(5, 4)
    assert samples_of_a_score(1, 0) is None and samples_of_a_score(2, None) is None
    assert samples_of_a_score(2, 0) is not None
    assert scores_past_the_prompt(8, 8) is None and scores_past_the_prompt(9, 8) is not None
    assert no_experts(False, False) is None and no_experts(True, True) is None
    assert no_experts(True, False) is not None
    assert not_loaded("", ()) is None and not_loaded("a", {"a"}) is None
    assert not_loaded("b", {"a"}) == "'b' is not loaded"
    assert newer_than_served(None, 1) is None and newer_than_served(1, 1) is None
    assert newer_than_served(2, 1) == "2 > served version 1"
    assert newer_than_served(2, 1, "x") == "2 > version 1 of adapter 'x'"


def test_the_engine_names_the_first_broken_rule_as_field_and_why() -> None:
    ok = SamplingParams(max_tokens=4)
    assert request_error([1, 2], ok, 1, None, LIMITS, 0) is None
    assert request_error([], ok, 0, None, LIMITS, 0) == "prompt: must not be empty"
    assert request_error([1], ok, 1, 3, LIMITS, 2) == "min_policy_version: 3 > served version 2"
    assert request_error([1], replace(ok, adapter="a"), 1, None, LIMITS, 0, {"a"}) is None
    bias = replace(ok, temperature=-1.0)
    assert request_error([1], bias, 1, None, LIMITS, 0) == "temperature: " + dict(
        bias.errors(100)
    ).get("temperature", "")


# (engine prompt, build_request's arguments, the service's field, the engine's field)
SAME_REASON: dict[str, tuple[list[int], dict[str, Any], str, str]] = {
    "empty": ([], {}, "token_ids.ids", "prompt"),
    "no room": ([1] * 16, {}, "prompt", "prompt"),
    "outside the vocabulary": ([1, 100], {}, "token_ids.ids", "prompt"),
    "too many samples": ([1], {"n": 5}, "n", "n"),
    "samples of a score": ([1], {"n": 2, "max_tokens": 0, "prompt_logprobs": True}, "n", "n"),
    "routed experts, dense model": (
        [1],
        {"routed_experts": True},
        "output.routed_experts",
        "routed_experts",
    ),
}


@pytest.mark.parametrize("case", SAME_REASON)
def test_the_service_and_the_engine_refuse_a_request_for_one_reason(case: str) -> None:
    prompt, kwargs, service_field, engine_field = SAME_REASON[case]
    request = build_request(prompt or [1], **kwargs)
    if not prompt:
        del request.token_ids.ids[:]
    ((field, why),) = field_violations(request, INFO, tokenizer=None)  # type: ignore[arg-type]
    params = SamplingParams(
        max_tokens=kwargs.get("max_tokens"),
        prompt_logprobs=kwargs.get("prompt_logprobs", False),
        routed_experts=kwargs.get("routed_experts", False),
    )
    error = request_error(prompt, params, kwargs.get("n", 1), None, LIMITS, 0)
    assert field == service_field
    assert error == f"{engine_field}: {why}"
