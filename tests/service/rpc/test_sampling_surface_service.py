"""The sampling surface through gRPC: the Python client's fields reach a real (tiny) engine,
bad words are tokenized by the service, and bad values are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice_client import AsyncClient, build_request

from service.rpc.sampling_surface import bad_word_ids
from tests.support.service_harness import running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [0, 17, 42, 99, 123, 7, 88]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path):
    async with running_server(tiny_llama, fake=False, engine={"num_kv_pages": 128}) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with AsyncClient(server[1]) as c:
        yield c


async def test_the_surface_reaches_the_engine(client):
    plain = (await client.complete(PROMPT, **GREEDY)).token_ids
    allowed = [t for t in range(30, 50) if t != plain[0]]
    restricted = await client.complete(PROMPT, allowed_token_ids=allowed, **GREEDY)
    assert set(restricted.token_ids) <= set(allowed)
    biased = await client.complete(PROMPT, logit_bias={77: 100.0}, **GREEDY)
    assert biased.token_ids == [77] * 12
    banned = await client.complete(PROMPT, bad_token_ids=plain[:2], **GREEDY)
    assert banned.token_ids[0] != plain[0] and not set(banned.token_ids) & set(plain[:2])


def occurs(seq: tuple[int, ...], tokens: list[int]) -> bool:
    return any(tuple(tokens[i : i + len(seq)]) == seq for i in range(len(tokens)))


async def test_a_bad_word_is_tokenized_and_never_generated(client, server):
    tokenizer = server[0].servicer.tokenizer
    for word in ("qz", "xq", "zzq", "jqx", "hello", "world"):  # one of two tokens
        sequences = await bad_word_ids([word], tokenizer)
        if len(sequences[0]) == 2:
            break
    else:
        pytest.fail("no candidate word is two tokens")
    first, second = sequences[0]
    # Sampling among the word's two tokens alone: without the ban the pair shows up.
    among = {"allowed_token_ids": [first, second], "temperature": 1.0, "seed": 11}
    options = {**GREEDY, **among}
    free = await client.complete(PROMPT, **options)
    assert occurs((first, second), free.token_ids), free.token_ids
    banned = await client.complete(PROMPT, bad_words=[word], **options)
    assert not any(occurs(seq, banned.token_ids) for seq in sequences), banned.token_ids


BAD = [
    ("bias_count", {"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias"),
    ("bias_value", {"logit_bias": {5: 100.5}}, "sampling.logit_bias"),
    ("bias_nan", {"logit_bias": {5: float("nan")}}, "sampling.logit_bias"),
    ("bias_id", {"logit_bias": {10**6: 1.0}}, "sampling.logit_bias"),
    ("allowed_count", {"allowed_token_ids": list(range(1025))}, "sampling.allowed_token_ids"),
    ("allowed_id", {"allowed_token_ids": [3, 10**6]}, "sampling.allowed_token_ids"),
    (
        "allowed_banned",
        {"allowed_token_ids": [3], "bad_token_ids": [3]},
        "sampling.allowed_token_ids",
    ),
    ("bad_id", {"bad_token_ids": [10**6]}, "sampling.bad_token_ids"),
    ("bad_ids_count", {"bad_token_ids": [1] * 1025}, "sampling.bad_token_ids"),
    ("words_count", {"bad_words": ["a"] * 65}, "sampling.bad_words"),
    ("word_length", {"bad_words": ["a" * 129]}, "sampling.bad_words"),
    ("word_blank", {"bad_words": ["  "]}, "sampling.bad_words"),
    ("word_tokens", {"bad_words": ["\u2603" * 100]}, "sampling.bad_words"),
]


@pytest.mark.parametrize(("name", "surface", "field"), BAD, ids=[b[0] for b in BAD])
async def test_bad_values_are_invalid_argument_naming_the_field(client, name, surface, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(build_request(PROMPT, **GREEDY, **surface))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == [field]


async def test_too_many_bad_words_are_refused_before_tokenizing(client, server, monkeypatch):
    async def encode(text, add_special_tokens=True):
        raise AssertionError("encoded")

    monkeypatch.setattr(server[0].servicer.tokenizer, "encode", encode)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(build_request(PROMPT, bad_words=["x"] * 65, **GREEDY))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_build_request_sets_the_surface():
    request = build_request(
        "hi", logit_bias={3: -1.5}, allowed_token_ids=[1, 2], bad_words=["no"], bad_token_ids=[9]
    )
    s = request.sampling
    assert dict(s.logit_bias) == {3: -1.5} and list(s.allowed_token_ids) == [1, 2]
    assert list(s.bad_words) == ["no"] and list(s.bad_token_ids) == [9]
