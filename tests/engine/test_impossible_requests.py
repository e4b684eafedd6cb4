"""A request whose every token's logit becomes -inf as it runs (its allowed ids banned away
by bad words that its output completes, or by min_tokens, which bans EOS) ends with ERROR saying no token is possible, having sent
no token outside what it allows; the requests beside it go on. With and without overlapped
steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from engine.protocol.messages import FinishReason, RequestOutput
from tests.support.overlap_runs import Request, make_engine, run

PROMPT = [0, 17, 42, 99, 123, 7, 88]
ALLOWED = (3, 8, 40)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_request_with_no_possible_token_ends_error_and_the_others_go_on(
    tiny_llama: Path, overlap: bool
) -> None:
    engine = make_engine(tiny_llama, overlap)
    eos = engine.model_config.eos_token_ids[0]
    sampled = {"temperature": 0.8, "seed": 7, "max_tokens": 8, "ignore_eos": True}
    requests = [
        Request("fine", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        Request(
            "min_tokens_sampled",
            PROMPT,
            SamplingParams(
                **{**sampled, "ignore_eos": False}, allowed_token_ids=(eos,), min_tokens=2
            ),
        ),
        # Any first token, then none: each pair is a bad word.
        Request(
            "bad_words",
            PROMPT,
            SamplingParams(
                **sampled,
                allowed_token_ids=(3, 8),
                bad_word_ids=((3, 3), (3, 8), (8, 3), (8, 8)),
                logprobs=True,
            ),
        ),
        Request(
            "min_tokens",
            PROMPT,
            SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=(eos,), min_tokens=2),
        ),
    ]
    errors: dict[str, str | None] = {}

    def on_output(_engine, out: RequestOutput, _seen) -> None:  # type: ignore[no-untyped-def]
        if out.finish_reason is not None:
            errors[out.request_id] = out.error

    seen = run(engine, requests, on_output)
    fine = seen["fine", 0]
    assert fine.finish_reason is FinishReason.LENGTH and len(fine.token_ids) == 8
    for rid in ("min_tokens_sampled", "bad_words", "min_tokens"):
        assert seen[rid, 0].finish_reason is FinishReason.ERROR, rid
    for rid in ("min_tokens_sampled", "min_tokens"):
        assert seen[rid, 0].token_ids == []
        assert errors[rid] == (
            "no token is possible: every token's logit is -inf after allowed_token_ids and "
            "min_tokens (at output token 0)"
        )
    bad = seen["bad_words", 0]
    assert len(bad.token_ids) == 1 and bad.token_ids[0] in (3, 8)
    assert len(bad.logprobs) == 1 and bad.logprobs[0] <= 0.0
    assert errors["bad_words"] == (
        "no token is possible: every token's logit is -inf after allowed_token_ids and "
        "bad_words (at output token 1)"
    )
    assert seen["min_tokens", 0].token_ids == []
    assert (
        errors["min_tokens"] is not None
        and "allowed_token_ids and min_tokens" in errors["min_tokens"]
    )
    assert engine.pool.num_free == engine.pool.num_pages - engine.cache.num_cached
