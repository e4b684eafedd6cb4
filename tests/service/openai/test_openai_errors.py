"""Errors as OpenAI's error JSON with the matching status, through the real openai SDK and
plain HTTP: fields named, the bearer token, unknown models, hostile bodies, /health,
/v1/models and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.service.openai.conftest import API_TOKEN

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


async def test_a_bad_field_is_bad_request_naming_it(front):
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.completions.create(model=front.model, prompt="hi", temperature=-1)
    assert caught.value.body["param"] == "temperature"
    assert "temperature" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.completions.create(model=front.model, prompt="hi", suffix="!")
    assert caught.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.completions.create(model=front.model, prompt="hi", logprobs=21)
    assert caught.value.body["param"] == "logprobs"


async def test_unsupported_chat_fields_are_refused_by_name(front):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.chat.completions.create(
            model=front.model, messages=[{"role": "user", "content": "hi"}], tools=tools
        )
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.chat.completions.create(
            model=front.model, messages=[{"role": "user", "content": "hi"}], presence_penalty=3
        )
    assert caught.value.body["param"] == "presence_penalty"


async def test_a_wrong_key_is_an_authentication_error(front):
    wrong = openai.AsyncOpenAI(base_url=front.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.completions.create(model=front.model, prompt="hi", max_tokens=1)
    await wrong.close()


async def test_an_unknown_model_is_not_found(front):
    with pytest.raises(openai.NotFoundError) as caught:
        await front.sdk.completions.create(model="gpt-5", prompt="hi", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"


async def test_models_lists_the_served_model(front):
    models = await front.sdk.models.list()
    assert [m.id for m in models.data] == [front.model]


async def call(front, method: str, path: str, body: bytes | dict | None = None, **headers):
    """(status, JSON body or None) of one plain HTTP call with the API key."""
    data = body if isinstance(body, bytes) else None
    json_body = body if isinstance(body, dict) else None
    async with (
        aiohttp.ClientSession(headers={**AUTH, **headers}) as session,
        session.request(method, front.base_url + path, data=data, json=json_body) as response,
    ):
        text = await response.text()
        return response.status, json.loads(text) if text else None


async def test_health_needs_no_key_and_says_serving(front):
    async with (
        aiohttp.ClientSession() as session,
        session.get(front.base_url + "/health") as response,
    ):
        assert response.status == 200


async def test_a_body_over_the_bound_is_refused_before_it_is_read(front):
    limit = front.server.config.max_message_bytes
    body = b'{"prompt": "' + b"a" * limit + b'"}'
    status, answer = await call(front, "POST", "/v1/completions", body)
    assert status == 413 and answer["error"]["code"] == "request_too_large"


async def test_a_body_that_is_not_json_is_bad_request(front):
    status, answer = await call(front, "POST", "/v1/completions", b"{nope")
    assert status == 400 and answer["error"]["code"] == "invalid_json"


async def test_tokenize_and_detokenize_round_trip_as_sluice_tokenize(front):
    text = "The quick brown fox"
    _, tokens = await call(front, "POST", "/tokenize", {"prompt": text})
    _, detokenized = await call(front, "POST", "/detokenize", tokens)
    status, refused = await call(front, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and refused["error"]["param"] == "tokens"
    assert tokens["tokens"] == await front.grpc.tokenize(text, True)
    assert tokens["count"] == len(tokens["tokens"])
    assert detokenized["prompt"] == text
