"""/v1/completions through the real openai SDK: the same tokens as sluice.v1, streamed with
usage, echo with logprobs equal to sluice.v1's prompt logprobs."""

from __future__ import annotations

import pytest
from sluice_client import build_request

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

PROMPT = "The quick brown fox jumps over the lazy dog"


async def test_greedy_completion_equals_sluice_generate_token_for_token(front):
    answer = await front.sdk.completions.create(
        model=front.model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    direct = await front.grpc.complete(
        build_request(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    choice = answer.choices[0].model_dump()
    assert choice["token_ids"] == direct.token_ids
    assert choice["text"] == direct.text
    assert choice["prompt_token_ids"] == await front.grpc.tokenize(PROMPT, True)
    assert answer.choices[0].finish_reason == "length"
    assert choice["policy_version"] == 0
    assert choice["version_spans"] == [{"policy_version": 0, "start": 0, "end": 12}]
    assert answer.usage.completion_tokens == 12
    assert answer.usage.prompt_tokens == len(choice["prompt_token_ids"])


async def test_token_id_prompts_give_one_choice_each_in_order(front):
    ids = [await front.grpc.tokenize(p, True) for p in ("Hello there", "To be, or not")]
    answer = await front.sdk.completions.create(
        model=front.model,
        prompt=ids,
        max_tokens=5,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(ids):
        direct = await front.grpc.complete(
            build_request(prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
        )
        assert answer.choices[2 * i].text == direct.text == answer.choices[2 * i + 1].text


async def test_streamed_completion_has_the_same_text_and_usage_last(front):
    whole = await front.sdk.completions.create(
        model=front.model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = await front.sdk.completions.create(
        model=front.model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


async def test_echo_logprobs_equal_sluice_prompt_logprobs(front):
    answer = await front.sdk.completions.create(
        model=front.model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    direct = await front.grpc.complete(
        build_request(
            PROMPT,
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=True,
            logprobs=True,
            top_logprobs=2,
        )
    )
    logprobs = answer.choices[0].logprobs
    prompt_len = direct.started.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:prompt_len] == pytest.approx(direct.prompt_logprobs, abs=0)
    assert logprobs.token_logprobs[prompt_len:] == pytest.approx(direct.logprobs, abs=0)
    assert len(logprobs.tokens) == prompt_len + 1
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert answer.choices[0].text.startswith(PROMPT)
    offsets = [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    for position, top in enumerate(logprobs.top_logprobs[1:], start=1):
        # two alternatives, plus the position's own token when it is not among them
        assert 2 <= len(top) <= 3
        assert max(top.values()) >= logprobs.token_logprobs[position]


async def test_echo_with_max_tokens_zero_scores_only_the_prompt(front):
    answer = await front.sdk.completions.create(
        model=front.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0
    )
    choice = answer.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == answer.usage.prompt_tokens
    assert answer.usage.completion_tokens == 0


async def test_a_seeded_sample_is_sluice_generate_with_that_seed(front):
    answers = [
        await front.sdk.completions.create(
            model=front.model,
            prompt=PROMPT,
            max_tokens=10,
            temperature=1.0,
            seed=7,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        for _ in range(2)
    ]
    direct = await front.grpc.complete(
        build_request(PROMPT, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    )
    assert [a.choices[0].model_dump()["token_ids"] for a in answers] == [direct.token_ids] * 2


async def test_logit_bias_reaches_the_sampler(front):
    favoured = 42
    answer = await front.sdk.completions.create(
        model=front.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={str(favoured): 100},
        extra_body={"return_token_ids": True},
    )
    assert answer.choices[0].model_dump()["token_ids"] == [favoured] * 4
