"""End to end: prefix-cache hits reported to callers, and n samples of one prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
from sluice_client import AsyncClient, Client, Collector, build_request

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.service_harness import running_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SHARED = [0] + [(7 * i) % 290 + 2 for i in range(96)]  # a 97-token shared prefix


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tiny_llama: Path):
    server = running_server(tiny_llama, fake=False, engine={"num_kv_pages": 256})
    async with server as (_, address):
        yield address


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(target: str):
    async with AsyncClient(target) as c:
        yield c


async def collect(client: AsyncClient, request) -> Collector:  # type: ignore[no-untyped-def]
    collector = Collector()
    async for event in client.generate(request):
        collector.add(event)
    return collector


async def test_later_requests_sharing_a_prefix_report_cached_tokens(client: AsyncClient) -> None:
    first = await client.complete(build_request(SHARED + [5, 6], temperature=0.0, max_tokens=4))
    second = await client.complete(build_request(SHARED + [9, 9, 9], temperature=0.0, max_tokens=4))
    assert first.started.cached_tokens == 0
    assert second.started.cached_tokens >= 0.9 * len(SHARED)
    assert second.finished is not None
    assert second.finished.usage.cached_tokens == second.started.cached_tokens
    info = await client.info()
    assert 0.0 < info.kv_cache.prefix_cache_hit_ratio < 1.0


async def test_n_samples_each_finish_once_with_their_own_index(
    client: AsyncClient, tiny_llama: Path
) -> None:
    prompt = SHARED[:40]
    request = build_request(prompt, temperature=1.0, seed=21, max_tokens=8, ignore_eos=True, n=4)
    collector = await collect(client, request)
    indices = sorted(index for _, index in collector.completions)
    assert indices == [0, 1, 2, 3]
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    expected = [r.token_ids for r in engine.generate([prompt], params, n=4)]
    got = [c.token_ids for _, c in sorted(collector.completions.items(), key=lambda kv: kv[0][1])]
    assert got == expected
    assert all(c.reason == "LENGTH" for c in collector.completions.values())


async def test_a_stop_string_ends_only_the_sample_that_matched(client: AsyncClient) -> None:
    prompt = SHARED[:30]
    probe = await collect(
        client, build_request(prompt, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, n=2)
    )
    texts = {index: c.text for (_, index), c in probe.completions.items()}
    stop = texts[0][2:5]
    assert stop and stop not in texts[1]
    request = build_request(
        prompt, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, n=2, stop=[stop]
    )
    stopped = await collect(client, request)
    by_index = {index: c for (_, index), c in stopped.completions.items()}
    assert (
        by_index[0].reason == "STOP_STRING" and by_index[0].text == texts[0][: texts[0].index(stop)]
    )
    assert by_index[1].reason == "LENGTH" and by_index[1].text == texts[1]


async def test_complete_with_n_returns_every_sample_in_index_order(
    client: AsyncClient, target: str
) -> None:
    prompt = SHARED[:20]
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "ignore_eos": True}
    samples = await client.complete(prompt, n=3, **params)
    assert isinstance(samples, list) and [c.index for c in samples] == [0, 1, 2]
    assert all(c.started is not None and c.started.prompt_tokens == 20 for c in samples)
    by_request = await client.complete(build_request(prompt, n=3, **params))
    assert [c.token_ids for c in by_request] == [c.token_ids for c in samples]
    with Client(target) as sync_client:
        from_sync = await asyncio.to_thread(sync_client.complete, prompt, n=3, **params)
    assert [c.token_ids for c in from_sync] == [c.token_ids for c in samples]
    assert len({tuple(c.token_ids) for c in samples}) == 3  # three samples, not one thrice
    one = await client.complete(prompt, **params)
    assert not isinstance(one, list) and one.token_ids == samples[0].token_ids
