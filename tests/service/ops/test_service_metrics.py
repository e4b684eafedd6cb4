"""Prometheus metrics at /metrics (`--metrics-port`), read with prometheus_client's parser.

A real `sluice serve` on the tiny checkpoint: a known workload moves every counter by exactly
its amount, histograms count each request once, gauges return to idle; an engine kill counts
one restart; stalled scrapers slow neither generation nor other scrapes; a busy metrics port is
exit 1 with one line, before any engine starts. With the fake engine: every gRPC call is
counted by its final status, refusals and cancellations included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import socket
import time
import typing
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from sluice_client import AsyncClient, Client, build_request

from service.ops.metrics_http import MetricsHttpServer
from tests.support.server_process import ServerProcess, run_serve, server_process, wait_gone
from tests.support.service_harness import make_fake_model, running_server

REPO = Path(__file__).resolve().parents[3]
ADMIN_TOKEN = "metrics-admin"
HOLD = 99  # the fake engine keeps a prompt holding this id queued until it is aborted

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        return parse(page.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the module; tests compare scrapes taken before and after their work.
    Four-token pages and 64 of them: two requests of 164 tokens cannot both fit."""
    directory = tmp_path_factory.mktemp("metrics")
    (directory / "admin_token").write_text(ADMIN_TOKEN)
    flags = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32"]
    flags += ["--page-size", "4", "--num-kv-pages", "64", "--metrics-port", "0"]
    flags += ["--admin-token-file", str(directory / "admin_token")]
    with server_process(directory / "server.log", *flags) as running:
        running.wait_health("SERVING", timeout=120)
        yield running


def metrics_port(server: ServerProcess) -> int:
    return int(server.wait_for("metrics.listening")["port"])


def greedy(prompt: list[int], max_tokens: int, **params: object):  # type: ignore[no-untyped-def]
    return build_request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_a_known_workload_moves_every_metric_by_exactly_its_amount(server, tiny_llama):
    port = metrics_port(server)
    before = await asyncio.to_thread(scrape, port)
    shared = [0, 40, 41, 42, 43, 44, 45, 46, 47]  # two full pages, then one token
    prompts = [shared, [0, 50, 51], [0, 52, 53, 54], [0, 55, 56, 57, 58, 59], shared]
    async with AsyncClient(server.target) as client:
        done = [await client.complete(greedy(p, 8)) for p in prompts]  # the 5th hits the cache

        # Cancelled by id once its first token is out.
        cancelled = None
        async for event in client.generate(greedy([0, 60, 61], 400, request_id="to-cancel")):
            if event.HasField("tokens") and cancelled is None:
                cancelled = await client.cancel(["to-cancel"])
            if event.HasField("finished"):
                cancelled_usage = event.finished.usage
        assert cancelled is not None and list(cancelled.cancelled) == ["to-cancel"]

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete([0, 5], temperature=-1.0)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

        # Two that outgrow the KV cache together: the newer is preempted once, then resumes.
        both = [greedy([0, 70 + i, 71, 72], 160) for i in range(2)]
        done += await asyncio.gather(*(client.complete(r) for r in both))

    admin = Client(server.target, admin_token=ADMIN_TOKEN)
    with admin:
        applied = await asyncio.to_thread(admin.update_weights, str(tiny_llama))
        with pytest.raises(grpc.RpcError) as stale:
            await asyncio.to_thread(admin.update_weights, str(tiny_llama), policy_version=1)
        assert stale.value.code() is grpc.StatusCode.FAILED_PRECONDITION

    update = "/sluice.v1.Admin/UpdateWeights"
    # NOTE: a call is counted when its handler returns, which can be a moment after its caller
    # has the status (abort() sends it first): wait for the refused update's count too.
    refused_update = {"method": update, "code": "FAILED_PRECONDITION"}
    after = await _scrape_when_idle(
        port, lambda s: moved(before, s, "sluice_grpc_calls_total", **refused_update) > 0
    )
    assert [c.reason for c in done] == ["LENGTH"] * 7
    started = [c.started for c in done]
    assert all(s is not None for s in started)
    prompt_lens = [len(p) for p in prompts] + [3, 4, 4]
    cached = sum(s.cached_tokens for s in started if s is not None)
    assert cached == 8  # the 5th prompt's two full pages: a hit to count
    generated = 5 * 8 + cancelled_usage.completion_tokens + 2 * 160

    def counter(name: str, **labels: str) -> float:
        return moved(before, after, name, **labels)

    assert counter("sluice_requests_finished_total", reason="length") == 7
    assert counter("sluice_requests_finished_total", reason="cancelled") == 1
    assert counter("sluice_prompt_tokens_total") == sum(prompt_lens)
    assert counter("sluice_prefill_tokens_total") == sum(prompt_lens) - cached
    assert counter("sluice_generation_tokens_total") == generated
    assert counter("sluice_prefix_cache_queried_tokens_total") == sum(prompt_lens)
    assert counter("sluice_prefix_cache_hit_tokens_total") == cached
    assert counter("sluice_preemptions_total") == 1
    assert counter("sluice_engine_restarts_total") == 0
    assert counter("sluice_weight_updates_total", outcome="applied") == 1
    assert counter("sluice_weight_updates_total", outcome="refused") == 1
    generate = "/sluice.v1.Generation/Generate"
    assert counter("sluice_grpc_calls_total", method=generate, code="OK") == 8
    assert counter("sluice_grpc_calls_total", method=generate, code="INVALID_ARGUMENT") == 1
    assert counter("sluice_grpc_calls_total", method="/sluice.v1.Generation/Cancel", code="OK") == 1
    assert counter("sluice_grpc_calls_total", method=update, code="OK") == 1
    assert counter("sluice_grpc_calls_total", method=update, code="FAILED_PRECONDITION") == 1

    requests = 8  # the refused one never reached the engine
    for histogram in (
        "sluice_time_to_first_token_seconds",
        "sluice_request_duration_seconds",
        "sluice_request_queue_time_seconds",
        "sluice_request_prompt_tokens",
        "sluice_request_generation_tokens",
    ):
        assert counter(f"{histogram}_count") == requests, histogram
    assert counter("sluice_request_prompt_tokens_sum") == sum(prompt_lens)
    assert counter("sluice_request_generation_tokens_sum") == generated
    with_two_tokens = 7 + (cancelled_usage.completion_tokens >= 2)
    assert counter("sluice_inter_token_latency_seconds_count") == with_two_tokens
    assert counter("sluice_weight_update_duration_seconds_count") == 1

    assert value(after, "sluice_requests_running") == 0
    assert value(after, "sluice_requests_waiting") == 0
    assert value(after, "sluice_kv_cache_usage_ratio") == 0
    assert value(after, "sluice_policy_version") == applied.policy_version >= 1
    assert value(after, "sluice_engine_up") == 1
    assert value(after, "sluice_serving_state", state="serving") == 1
    assert value(after, "sluice_serving_state", state="restarting") == 0


async def _scrape_when_idle(
    port: int, settled: Callable[[Samples], bool] = lambda _: True, timeout: float = 10.0
) -> Samples:
    """The page once the engine has reported itself idle (its stats ride on its messages) and
    `settled` holds."""
    end = time.monotonic() + timeout
    while True:
        samples = await asyncio.to_thread(scrape, port)
        idle = value(samples, "sluice_requests_running") == 0
        if idle and value(samples, "sluice_kv_cache_usage_ratio") == 0 and settled(samples):
            return samples
        if time.monotonic() > end:
            return samples
        await asyncio.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_stalled_scrapers_block_neither_generation_nor_other_scrapes(server):
    """Twenty scrapers that connect and never read hold their sockets open while a generation
    and three scrapes run concurrently: all of them finish, with the tokens of a generation run
    without stalls. A metrics server that served connections one at a time would wait on the
    stalled ones (its read timeout is seconds each), so the bounds below only catch a hang; they
    compare nothing with the machine's speed."""
    port = metrics_port(server)
    async with AsyncClient(server.target) as client:

        async def generate() -> list[int]:
            completion = await client.complete(greedy([0, 80, 81], 64))
            assert completion.reason == "LENGTH"
            return completion.token_ids

        unstalled = await generate()
        with contextlib.ExitStack() as stack:
            for i in range(20):
                stalled = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
                if i % 2:  # half send a request and never read the answer
                    stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            scrapes = [asyncio.to_thread(scrape, port) for _ in range(3)]
            tokens, *pages = await asyncio.wait_for(asyncio.gather(generate(), *scrapes), 30)
    assert tokens == unstalled
    assert all(value(samples, "sluice_engine_up") == 1 for samples in pages)


def test_a_burst_of_connects_waits_in_the_listen_backlog_until_accepted():
    """Connects that arrive before the listener thread accepts them (here: it is not started)
    are completed by the kernel, up to the backlog; past it they hang until they time out."""
    http = MetricsHttpServer(CollectorRegistry(), "127.0.0.1", 0)
    burst = 256
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(burst)]
    try:
        with selectors.DefaultSelector() as selector:
            for sock in sockets:
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", http.port))
                selector.register(sock, selectors.EVENT_WRITE)
            connected, end = 0, time.monotonic() + 2.0
            while connected < burst and time.monotonic() < end:
                for key, _ in selector.select(timeout=max(0.0, end - time.monotonic())):
                    selector.unregister(key.fileobj)
                    sock = typing.cast(socket.socket, key.fileobj)
                    connected += sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        assert connected == burst
    finally:
        for sock in sockets:
            sock.close()
        http.stop()


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_an_engine_kill_counts_one_restart_and_the_new_engine_counts_from_zero(server):
    port = metrics_port(server)
    async with AsyncClient(server.target) as client:  # the engine to kill has counted tokens
        assert (await client.complete(greedy([0, 90, 91], 16))).reason == "LENGTH"
    before = await asyncio.to_thread(scrape, port)
    incarnation = len(server.events("engine.spawned"))
    pid = server.engine_pid(incarnation)
    os.kill(pid, signal.SIGKILL)
    assert await asyncio.to_thread(wait_gone, pid, 10)
    await asyncio.to_thread(server.wait_for, "engine.spawned", incarnation + 1)
    await asyncio.to_thread(server.wait_health, "SERVING", 60)
    after = await asyncio.to_thread(scrape, port)
    assert moved(before, after, "sluice_engine_restarts_total") == 1
    assert value(after, "sluice_engine_up") == 1
    assert value(after, "sluice_serving_state", state="serving") == 1
    # The new engine's own counters start at zero; its tokens still add to the totals.
    async with AsyncClient(server.target) as client:
        assert (await client.complete(greedy([0, 90, 91], 8))).reason == "LENGTH"
    later = await _scrape_when_idle(port)
    assert moved(after, later, "sluice_generation_tokens_total") == 8
    assert moved(after, later, "sluice_prompt_tokens_total") == 3


@pytest.mark.timeout(60)
async def test_a_busy_metrics_port_is_exit_1_with_one_line_before_any_engine(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ("--model", str(tiny_llama), "--device", "cpu", "--port", "0")
        # A None code: it started serving, the port check did not stop it.
        code, stderr = await run_serve(*flags, "--metrics-port", str(port), timeout=30)
    lines = stderr.splitlines()
    assert code == 1, lines
    assert len(lines) == 1, lines
    line = json.loads(lines[0])
    assert line["event"] == "server.bind_failed"
    assert line["error"].startswith(f"cannot listen on 127.0.0.1:{port} (metrics): ")
    assert "already in use" in line["error"]


async def test_every_grpc_call_is_counted_by_its_final_status(tmp_path):
    model = make_fake_model(tmp_path, hold_token=HOLD)
    async with running_server(model, api_token="t", max_concurrent_rpcs=1) as (server, target):
        registry = server.metrics.registry

        def calls(method: str, code: str) -> float:
            labels = {"method": f"/sluice.v1.Generation/{method}", "code": code}
            return registry.get_sample_value("sluice_grpc_calls_total", labels) or 0.0

        async with AsyncClient(target) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError):
                await anonymous.complete([0, 5], max_tokens=2)
        async with AsyncClient(target, api_token="t", retry=False) as client:
            held = client.stub.Generate(build_request([0, HOLD]), metadata=client.metadata)
            await _until(lambda: server.call_limit.in_use == 1)
            with pytest.raises(grpc.aio.AioRpcError) as over:
                await client.complete([0, 5], max_tokens=2)
            assert over.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            held.cancel()
            await _until(lambda: calls("Generate", "CANCELLED") == 1)
            unknown = client.channel.unary_unary("/sluice.v1.Generation/Nope")
            with pytest.raises(grpc.aio.AioRpcError):
                await unknown(b"", metadata=client.metadata)
        assert calls("Generate", "UNAUTHENTICATED") == 1
        assert calls("Generate", "RESOURCE_EXHAUSTED") == 1
        assert calls("Generate", "CANCELLED") == 1
        assert calls("Generate", "OK") == 0
        unimplemented = {"method": "unknown", "code": "UNIMPLEMENTED"}
        assert registry.get_sample_value("sluice_grpc_calls_total", unimplemented) == 1
        cancelled = {"reason": "cancelled"}
        assert registry.get_sample_value("sluice_requests_finished_total", cancelled) == 1


async def _until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)
