"""End to end: a real server on 127.0.0.1:0 with a real spawned engine on a tiny checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, Collector, build_request

from engine.protocol.messages import SamplingParams
from service.text.tokenizer import Tokenizer
from tests.support.service_harness import running_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

PROMPTS = [
    "The quick brown fox",
    "To be, or not to be",
    "Café, naïve, façade",
    "日本語のテキスト",
    "Call me Ishmael.",
    "Numbers: 0 1 2",
    "def main():",
    "Emoji: 😀 🚀",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer._tok.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy ids from the in-process engine."""
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
    results = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [r.token_ids for r in results]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tiny_llama: Path):
    async with running_server(tiny_llama, fake=False, engine={"num_kv_pages": 256}) as (_, t):
        yield t


@pytest_asyncio.fixture(loop_scope="module")
async def client(target: str):
    async with AsyncClient(target) as c:
        yield c


async def no_pages_in_use(client: AsyncClient) -> bool:
    """Every page is free or reclaimable in the prefix cache (none held by a request)."""
    for _ in range(200):
        kv = (await client.info()).kv_cache
        if kv.free_pages + kv.cached_pages == kv.total_pages:
            return True
        await asyncio.sleep(0.05)
    return False


def greedy(prompt: str | list[int], **params) -> pb.GenerateRequest:
    return build_request(prompt, temperature=0.0, max_tokens=MAX_TOKENS, **params)


async def test_generate_greedy_ids_equal_the_in_process_engine(client, prompt_ids, reference):
    for ids, expected in zip(prompt_ids, reference, strict=True):
        completion = await client.complete(greedy(ids))
        assert completion.token_ids == expected
        assert completion.started.prompt_tokens == len(ids)


async def test_text_prompts_tokenize_like_the_tokenizer(client, reference):
    completion = await client.complete(greedy(PROMPTS[0]))
    assert completion.token_ids == reference[0]


async def test_64_concurrent_generate_streams_are_all_correct(client, prompt_ids, reference):
    picks = [i % len(PROMPTS) for i in range(64)]
    completions = await asyncio.gather(*(client.complete(greedy(prompt_ids[i])) for i in picks))
    assert [c.token_ids for c in completions] == [reference[i] for i in picks]


async def test_one_stream_with_32_requests_and_8_cancelled_midway(client, prompt_ids, reference):
    stream = client.stream()
    cancel = {f"r{i}" for i in range(0, 32, 4)}
    for i in range(32):
        rid = f"r{i}"
        long = rid in cancel  # these would run long enough to be cancelled midway
        params = {"max_tokens": 400, "ignore_eos": True} if long else {}
        request = build_request(
            prompt_ids[i % len(PROMPTS)],
            request_id=rid,
            temperature=0.0,
            **({"max_tokens": MAX_TOKENS} | params),
        )
        await stream.start(request)
    collector, cancelled_sent = Collector(), False
    async for event in stream:
        collector.add(event)
        running = [collector.completions.get((rid, 0)) for rid in cancel]
        if not cancelled_sent and all(c is not None and c.token_ids for c in running):
            for rid in sorted(cancel):
                await stream.cancel(rid)
            await stream.done_sending()
            cancelled_sent = True
    assert cancelled_sent
    for i in range(32):
        c = collector.completions[(f"r{i}", 0)]
        if c.request_id in cancel:
            assert c.reason == "CANCELLED" and 0 < len(c.token_ids) < 400
        else:
            assert c.reason in ("STOP", "LENGTH") and c.token_ids == reference[i % len(PROMPTS)]
    assert await no_pages_in_use(client)


async def test_client_disconnect_returns_the_pages(client, prompt_ids):
    events = client.generate(build_request(prompt_ids[0], max_tokens=400, ignore_eos=True))
    async for event in events:
        if event.WhichOneof("event") == "tokens":
            break
    await events.aclose()
    assert await no_pages_in_use(client)


async def test_expired_deadline_returns_the_pages(client, prompt_ids):
    # 400 tokens take about 0.7 s or more on the CPU: the deadline passes mid-generation. Either
    # side may notice first: the client's deadline (DEADLINE_EXCEEDED status) or the engine's
    # (the stream ends OK with `finished` DEADLINE_EXCEEDED).
    request = build_request(prompt_ids[0], max_tokens=400, ignore_eos=True)
    try:
        completion = await client.complete(request, timeout=0.15)
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert completion.reason == "DEADLINE_EXCEEDED", completion.reason
    assert await no_pages_in_use(client)


async def test_cancel_of_unknown_ids_lists_them_in_not_found(client):
    response = await client.cancel(["never-1", "never-2"])
    assert list(response.cancelled) == [] and list(response.not_found) == ["never-1", "never-2"]


async def test_chunk_texts_concatenate_to_the_decode_of_all_ids(client, tokenizer):
    multibyte_split = False
    for seed in range(6):
        collector = Collector()
        async for event in client.generate(
            PROMPTS[seed % len(PROMPTS)], max_tokens=48, seed=seed, ignore_eos=True
        ):
            collector.add(event)
            multibyte_split |= event.HasField("tokens") and event.tokens.text == ""
        (c,) = collector.completions.values()
        assert c.text == tokenizer.decode(c.token_ids)
    assert multibyte_split, "no chunk held back an incomplete character; pick other seeds"


async def test_stop_string_split_across_chunks(client, tokenizer, prompt_ids, reference):
    ids = reference[0]
    full = tokenizer.decode(ids)
    # A two-character stop string straddling a token boundary, so no single chunk holds it.
    for k in range(1, len(ids)):
        p = len(tokenizer.decode(ids[:k]))
        stop = full[p - 1 : p + 1]
        if (
            0 < p < len(full)
            and "\ufffd" not in stop
            and len(stop) == 2
            and full.find(stop) == p - 1
        ):
            break
    else:
        pytest.skip("no token boundary to straddle in this completion")
    for include in (False, True):
        c = await client.complete(
            greedy(prompt_ids[0], stop=[stop], include_stop_str_in_output=include)
        )
        assert c.reason == "STOP_STRING" and c.finished.matched_stop == stop
        assert c.text == full[: p - 1 + (2 if include else 0)]
        assert c.token_ids == ids[: k + 1]


BAD = [
    (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (build_request([0, 10**6]), grpc.StatusCode.INVALID_ARGUMENT),
    (build_request("x", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
    (build_request("x", top_logprobs=50), grpc.StatusCode.INVALID_ARGUMENT),
    (build_request("x", n=0), grpc.StatusCode.INVALID_ARGUMENT),
    (build_request([5] * 600), grpc.StatusCode.INVALID_ARGUMENT),  # longer than the context
]


@pytest.mark.parametrize(("request_", "code"), BAD)
async def test_bad_input_gets_its_status_code_and_the_server_keeps_serving(
    client, request_, code, prompt_ids, reference
):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(request_)
    assert err.value.code() == code
    assert (await client.complete(greedy(prompt_ids[1]))).token_ids == reference[1]


async def test_server_info_describes_the_model(client):
    info = await client.info()
    assert info.state == pb.SERVING_STATE_SERVING
    assert info.max_model_len == 512 and info.vocab_size > 0
    assert info.kv_cache.total_pages == 256


async def test_a_stream_interval_sends_the_same_tokens_in_fewer_chunks(
    tiny_llama, prompt_ids, reference, tokenizer
):
    # A long interval: after the first chunk, everything waits for the final output, which
    # cuts the wait short (the whole generation takes far less than the interval).
    async with (
        running_server(
            tiny_llama, fake=False, engine={"num_kv_pages": 256}, stream_interval=30.0
        ) as (_, target),
        AsyncClient(target) as client,
    ):
        for ids, expected in zip(prompt_ids[:3], reference[:3], strict=True):
            chunks = [
                e.tokens
                async for e in client.generate(greedy(ids), timeout=20.0)
                if e.WhichOneof("event") == "tokens"
            ]
            assert len(chunks) <= 2
            assert [t for c in chunks for t in c.token_ids] == expected
            assert "".join(c.text for c in chunks) == tokenizer.decode(expected)
