"""/v1/chat/completions through the real openai SDK: the checkpoint's chat template, greedy
equal to sluice.v1's chat prompt, streamed with usage, structured output, logprobs."""

from __future__ import annotations

import json

import jsonschema
import pytest
from sluice.v1 import generation_pb2 as pb
from sluice_client import build_request

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a fox."},
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def sluice_chat(max_tokens: int, **params) -> pb.GenerateRequest:
    request = build_request("", max_tokens=max_tokens, temperature=0.0, **params)
    request.chat.messages.extend(
        pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES
    )
    return request


async def test_chat_greedy_equals_sluice_chat_prompt(front):
    answer = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_completion_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    direct = await front.grpc.complete(sluice_chat(8, ignore_eos=True))
    body = answer.model_dump()
    assert body["choices"][0]["token_ids"] == direct.token_ids
    assert answer.choices[0].message.content == direct.text
    assert answer.choices[0].message.role == "assistant"
    assert (
        answer.usage.prompt_tokens == direct.started.prompt_tokens == len(body["prompt_token_ids"])
    )
    assert answer.object == "chat.completion"


async def test_streamed_chat_matches_whole_and_ends_with_usage(front):
    whole = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    stream = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts = ["", ""]
    roles = set()
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles.add(choice.delta.role)
        last = chunk
    assert texts == [c.message.content for c in whole.choices]
    assert "assistant" in roles
    assert last.choices == [] and last.usage == whole.usage


async def test_json_schema_response_format_validates(front):
    answer = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


async def test_json_object_response_format_gives_an_object(front):
    answer = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


async def test_chat_logprobs_equal_sluice_logprobs_with_top_alternatives(front):
    answer = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    direct = await front.grpc.complete(sluice_chat(5, ignore_eos=True, logprobs=True))
    content = answer.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(direct.logprobs, abs=0)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == answer.choices[0].message.content


async def test_stop_string_ends_the_choice_with_its_stop_reason(front):
    whole = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = whole.choices[0].message.content
    stop = text[3:5]
    answer = await front.sdk.chat.completions.create(
        model=front.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].message.content == text[: text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    assert answer.model_dump()["choices"][0]["stop_reason"] == stop
