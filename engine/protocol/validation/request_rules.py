"""The rules a new request must pass, one function each, applied by both processes.

The service applies them at admission, to the proto (before sending anything), and refuses a
request that breaks one INVALID_ARGUMENT naming the proto field (service/rpc/admission.py);
the engine applies them all again to each AddRequest (`request_error`), because one can reach
it past the service's check (an adapter unloaded, an in-process caller), and ends such a
request with ERROR, `field: why`. Each rule returns its `why` (None: kept), in the words both
processes report it with; the field is the caller's to name (`prompt` in the engine,
`token_ids.ids` or `text` in the service, ...).

The sampling parameters' own fields are checked by SamplingParams.errors
(engine/protocol/sampling_params.py), with these. Plain values only: the model's limits come in
a RequestLimits, made from the engine's ModelConfig or the service's ModelInfo.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from engine.protocol.messages import ModelInfo, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is judged against: the model's and the engine's limits."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int  # also the largest n
    moe: bool  # the model has mixture-of-experts layers (routed experts can be returned)

    @classmethod
    def of(cls, info: ModelInfo) -> RequestLimits:
        return cls(info.vocab_size, info.max_model_len, info.max_num_seqs, info.moe_layers > 0)


def empty_prompt(prompt_len: int) -> str | None:
    return "must not be empty" if prompt_len == 0 else None


def no_room(prompt_len: int, max_model_len: int) -> str | None:
    """A prompt that leaves no position to generate (or score past) in the context."""
    if prompt_len < max_model_len:
        return None
    return f"{prompt_len} prompt tokens leave no room in the context of {max_model_len} tokens"


def outside_vocabulary(token_ids: Sequence[int], vocab_size: int) -> str | None:
    if all(0 <= t < vocab_size for t in token_ids):
        return None
    return f"every id must be in the vocabulary [0, {vocab_size})"


def samples_out_of_range(n: int, max_num_seqs: int) -> str | None:
    return None if 1 <= n <= max_num_seqs else f"must be in [1, {max_num_seqs}] (max_num_seqs)"


def samples_of_a_score(n: int, max_tokens: int | None) -> str | None:
    """n > 1 with nothing to generate: the samples of a scored prompt would all be one."""
    return "must be 1 to score a prompt (max_tokens 0)" if max_tokens == 0 and n > 1 else None


def scores_past_the_prompt(start: int, prompt_len: int) -> str | None:
    """prompt_logprobs_start past the prompt's end."""
    return f"must be at most the prompt's {prompt_len} tokens" if start > prompt_len else None


def no_experts(routed_experts: bool, moe: bool) -> str | None:
    return "the model has no mixture-of-experts layers" if routed_experts and not moe else None


def not_loaded(adapter: str, loaded: Container[str]) -> str | None:
    return f"{adapter!r} is not loaded" if adapter and adapter not in loaded else None


def newer_than_served(min_version: int | None, served: int, adapter: str = "") -> str | None:
    """min_policy_version above the version it would run (`served`: its adapter's, when it
    names one)."""
    if min_version is None or min_version <= served:
        return None
    if adapter:
        return f"{min_version} > version {served} of adapter {adapter!r}"
    return f"{min_version} > served version {served}"


def request_error(
    prompt: list[int],
    params: SamplingParams,
    n: int,
    min_version: int | None,
    limits: RequestLimits,
    policy_version: int,
    adapters: Container[str] = (),
) -> str | None:
    """The engine's judgement of a request: what is wrong with it, as `field: why` (the
    parameters' errors joined by '; '), or None. `policy_version`: the version it would run,
    its adapter's when it names one."""
    checks = (
        ("prompt", lambda: empty_prompt(len(prompt))),
        ("prompt", lambda: no_room(len(prompt), limits.max_model_len)),
        ("prompt", lambda: outside_vocabulary(prompt, limits.vocab_size)),
        ("n", lambda: samples_out_of_range(n, limits.max_num_seqs)),
        ("", lambda: "; ".join(f"{f}: {why}" for f, why in params.errors(limits.vocab_size))),
        ("prompt_logprobs_start", lambda: _scores_past(params, len(prompt))),
        ("n", lambda: samples_of_a_score(n, params.max_tokens)),
        ("routed_experts", lambda: no_experts(params.routed_experts, limits.moe)),
        ("adapter", lambda: not_loaded(params.adapter, adapters)),
        (
            "min_policy_version",
            lambda: newer_than_served(min_version, policy_version, params.adapter),
        ),
    )
    for field, check in checks:
        if why := check():
            return f"{field}: {why}" if field else why
    return None


def _scores_past(params: SamplingParams, prompt_len: int) -> str | None:
    if not params.prompt_logprobs:
        return None
    return scores_past_the_prompt(params.prompt_logprobs_start, prompt_len)
