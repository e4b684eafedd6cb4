"""The checks a new request passes before it is queued; a failure is that request's ERROR output.

The sampling parameters check their own fields (SamplingParams.errors, engine/protocol/messages.py).
"""

from __future__ import annotations

from collections.abc import Container

from engine.models.hf_config import ModelConfig
from engine.protocol.messages import SamplingParams


def request_error(
    prompt: list[int],
    params: SamplingParams,
    n: int,
    min_version: int | None,
    model: ModelConfig,
    max_num_seqs: int,
    policy_version: int,
    adapters: Container[str] = (),
) -> str | None:
    """What is wrong with this request, as `field: why` (several joined by '; '), or None.
    `policy_version`: the version it would run, its adapter's when it names one."""
    vocab, max_len = model.vocab_size, model.max_model_len
    if not prompt:
        return "prompt: is empty"
    if len(prompt) >= max_len:
        return f"prompt: {len(prompt)} tokens leave no room in the context of {max_len}"
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        return f"prompt: token id {bad} is outside the vocabulary [0, {vocab})"
    if not 1 <= n <= max_num_seqs:
        return f"n: must be in [1, max_num_seqs={max_num_seqs}]"
    errors = params.errors(vocab)
    if errors:
        return "; ".join(f"{name}: {why}" for name, why in errors)
    if params.prompt_logprobs and params.prompt_logprobs_start > len(prompt):
        return f"prompt_logprobs_start: must be at most the prompt's length, {len(prompt)} tokens"
    if params.max_tokens == 0 and n > 1:
        return "n: must be 1 to score a prompt (max_tokens 0)"
    if params.routed_experts and model.moe is None:
        return "routed_experts: the model has no mixture-of-experts layers"
    if params.adapter and params.adapter not in adapters:
        return f"adapter: {params.adapter!r} is not loaded"
    if min_version is not None and min_version > policy_version:
        if params.adapter:
            adapter = f"version {policy_version} of adapter {params.adapter!r}"
            return f"min_policy_version: {min_version} > {adapter}"
        return f"min_policy_version: {min_version} > served version {policy_version}"
    return None
