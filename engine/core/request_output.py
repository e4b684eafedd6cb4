"""What a request reports after a step: its RequestOutput, and whether its last token ended it.

Plain functions over a Request (engine/scheduling/request.py) for the RequestTable and the
Postprocessor; the served policy version is the caller's to pass (a request running an adapter
reports its adapter's version instead).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.protocol.messages import FinishReason, RequestMetrics, RequestOutput
from engine.scheduling.request import Request


def request_output(
    req: Request,
    tokens: list[int],
    logprobs: list[float] | None,
    top: list[tuple[list[int], list[float]]] | None,
    policy_version: int,
) -> RequestOutput:
    """The output of `req` for this step: its new tokens, and its end and timings if it ended;
    its version is its adapter's when it runs one (`policy_version`: the served one's)."""
    metrics = None
    if req.is_finished and req.finish_time is not None:
        first_token = req.first_token_time or req.finish_time
        metrics = RequestMetrics(
            queue_time=(req.first_scheduled_time or req.finish_time) - req.arrival_time,
            time_to_first_token=first_token - req.arrival_time,
            decode_time=req.finish_time - first_token,
            proposed_tokens=req.spec_proposed,
            accepted_tokens=req.spec_accepted,
        )
    return RequestOutput(
        request_id=req.request_id,
        index=req.index,
        new_token_ids=tokens,
        policy_version=req.adapter_version or policy_version,
        logprobs=logprobs,
        top_logprobs=top,
        finish_reason=req.finish_reason,
        error=req.error,
        prompt_tokens=req.prompt_len,
        cached_tokens=req.num_cached_tokens,
        completion_tokens=req.num_output_tokens,
        metrics=metrics,
        spec_tokens=(req.spec_proposed, req.spec_accepted) if req.spec_proposed else None,
    )


def error_output(
    request_id: str,
    index: int,
    prompt_len: int,
    error: str | None,
    policy_version: int,
    reason: FinishReason = FinishReason.ERROR,
) -> RequestOutput:
    """The one output of a request refused before it was queued (ERROR: bad input;
    ABORTED: the engine sleeps)."""
    return RequestOutput(
        request_id=request_id,
        index=index,
        new_token_ids=[],
        policy_version=policy_version,
        finish_reason=reason,
        error=error,
        prompt_tokens=prompt_len,
    )


def stop_reason(req: Request, token: int, eos_token_ids: Sequence[int]) -> FinishReason | None:
    """Why `req` ends with `token` just appended (an EOS or stop token, its structured-output
    text complete and ended, its length), if it does."""
    params = req.params
    if not params.ignore_eos and token in eos_token_ids:
        return FinishReason.STOP
    if token in params.stop_token_ids or (req.grammar is not None and req.grammar.terminated):
        return FinishReason.STOP
    if req.num_output_tokens >= req.max_tokens:
        return FinishReason.LENGTH
    return None
