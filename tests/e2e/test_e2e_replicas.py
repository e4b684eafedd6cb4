"""Two real replicas behind nginx running the shipped deploy/nginx/sluice.conf, on loopback.

Each replica is `python -m service` on a tiny checkpoint with its own metrics port: the
replicas' counters say which one served what. nginx comes from Debian's package (.ci/run
installs it, scripts/ensure_nginx.sh); without it these tests are skipped, and say so, except
under SLUICE_REQUIRE_NGINX=1 (set by .ci/run), where a missing nginx fails them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sluice_client import AsyncClient, Client, cli, pb, update_all

from tests.support.nginx_process import NginxProcess, nginx_binary, nginx_process
from tests.support.server_process import ServerProcess
from tests.support.tiny_models import load_hf_model, make_checkpoint

NGINX = nginx_binary()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        NGINX is None and os.environ.get("SLUICE_REQUIRE_NGINX") != "1",
        reason="nginx is not installed (.ci/run installs it: scripts/ensure_nginx.sh)",
    ),
]

ADMIN_TOKEN = "replicas-admin"
FINISHED = "sluice_requests_finished_total"
PREFIX_HITS = "sluice_prefix_cache_hit_tokens_total"


def start_replica(directory: Path, checkpoint: Path) -> ServerProcess:
    (directory / "admin_token").write_text(ADMIN_TOKEN)
    flags = ["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32"]
    flags += ["--page-size", "4", "--metrics-port", "0", "--retry-after", "0.2"]
    flags += ["--admin-token-file", str(directory / "admin_token")]
    return ServerProcess(directory / "server.log", *flags, new_session=True)


@contextlib.contextmanager
def replicas(root: Path, checkpoint: Path, count: int) -> Iterator[list[ServerProcess]]:
    """`count` replicas started together (their engines load in parallel), SERVING."""
    started = []
    try:
        for i in range(count):
            (root / f"r{i}").mkdir()
            started.append(start_replica(root / f"r{i}", checkpoint))
        for replica in started:
            replica.wait_health("SERVING", timeout=120)
        yield started
    finally:
        for replica in started:
            kill_group(replica)


def kill_group(replica: ServerProcess) -> None:
    """SIGKILL the replica and its engine (its process group), as a crashed machine would."""
    if replica.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(replica.proc.pid, signal.SIGKILL)
    replica.stop()


@pytest.fixture(scope="module", autouse=True)
def nginx_is_there_when_required() -> None:
    if NGINX is None and os.environ.get("SLUICE_REQUIRE_NGINX") == "1":
        pytest.fail("SLUICE_REQUIRE_NGINX=1 but nginx is not installed (scripts/ensure_nginx.sh)")


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("replica_b"), "llama", seed=1)


@pytest.fixture(scope="module")
def pair(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    with replicas(tmp_path_factory.mktemp("pair"), tiny_llama, 2) as both:
        yield both


@pytest.fixture(scope="module")
def nginx(
    pair: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NginxProcess]:
    assert NGINX is not None
    directory = tmp_path_factory.mktemp("nginx")
    with nginx_process(NGINX, directory, [r.target for r in pair]) as running:
        yield running


async def complete_all(target: str, prompts: list[list[int]], concurrency: int = 16, **params):  # type: ignore[no-untyped-def]
    """Completions of every prompt through `target`, `concurrency` at a time."""
    limit = asyncio.Semaphore(concurrency)
    async with AsyncClient(target) as client:

        async def one(prompt: list[int]):  # type: ignore[no-untyped-def]
            async with limit:
                return await client.complete(prompt, temperature=0.0, ignore_eos=True, **params)

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.timeout(60)
async def test_200_requests_through_nginx_all_succeed_and_both_replicas_serve_some(pair, nginx):
    before = [r.metric(FINISHED) for r in pair]
    prompts = [[0, 1 + i % 250, 2 + i % 97] for i in range(200)]
    done = await complete_all(nginx.target, prompts, max_tokens=2)
    served = [r.metric(FINISHED) - b for r, b in zip(pair, before, strict=True)]
    assert [c.reason for c in done] == ["LENGTH"] * 200
    assert sum(served) == 200 and min(served) > 0, served


@pytest.mark.timeout(60)
async def test_requests_without_a_key_go_to_the_replica_with_fewer_calls_in_flight(pair, nginx):
    async with AsyncClient(nginx.target) as client:
        # A GenerateStream call held open is one call in flight on one replica for as long as
        # it stays open, however soon its request finishes. Which replica that is: the one
        # whose finished counter moved once the request's `finished` event is read (the
        # counter goes up before the event is sent). Polling `running` instead races the
        # request, which may finish before a poll sees it.
        before_held = [r.metric(FINISHED) for r in pair]
        held = client.stream()
        await held.start([0, 30, 31], max_tokens=2, ignore_eos=True)
        # NOTE: read from the call itself: leaving an `async for` over the stream would
        # cancel the call once its generator is collected.
        while not (await held.call.read()).HasField("finished"):
            pass
        before = [r.metric(FINISHED) for r in pair]
        held_on = [b - a for a, b in zip(before_held, before, strict=True)]
        assert sorted(held_on) == [0, 1], held_on
        busy = held_on.index(1)
        for i in range(10):
            await client.complete([0, 31, i], max_tokens=1)
        served = [r.metric(FINISHED) - b for r, b in zip(pair, before, strict=True)]
        await held.done_sending()  # the call ends: its only request has finished
        assert await held.call.read() is grpc.aio.EOF
    # Round robin would have split them 5 and 5.
    assert served[1 - busy] == 10 and served[busy] == 0, (busy, served)


@pytest.mark.timeout(60)
async def test_requests_with_one_affinity_key_land_on_one_replica_and_hit_its_prefix_cache(
    pair, nginx
):
    before = [(r.metric(FINISHED), r.metric(PREFIX_HITS)) for r in pair]
    shared = [0, *range(40, 72)]  # 33 tokens: 8 full pages of 4
    prompts = [[*shared, 100 + i] for i in range(20)]
    async with AsyncClient(nginx.target, affinity="conversation-7") as client:
        for prompt in prompts:  # one after another: each finds its predecessors' pages
            completion = await client.complete(prompt, temperature=0.0, max_tokens=1)
            assert completion.reason == "LENGTH"
    after = [(r.metric(FINISHED), r.metric(PREFIX_HITS)) for r in pair]
    served = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sorted(served) == [0, 20], served
    chosen = served.index(20)
    assert hits[chosen] >= 19 * 32 and hits[1 - chosen] == 0, hits


@pytest.mark.timeout(60)
async def test_generate_stream_and_cancel_by_id_work_through_nginx(nginx):
    async with AsyncClient(nginx.target, affinity="rollout-group-3") as client:
        stream = client.stream()
        for i in range(4):
            await stream.start([0, 9, 10 + i], request_id=f"s{i}", max_tokens=3, ignore_eos=True)
        await stream.start([0, 9, 20], request_id="long", max_tokens=400, ignore_eos=True)
        finished: dict[str, int] = {}
        cancelled = None
        async for event in stream:
            if event.request_id == "long" and event.HasField("tokens") and cancelled is None:
                # Cancel from another call: the same key reaches the replica that runs it.
                cancelled = await client.cancel(["long"])
            if event.HasField("finished"):
                finished[event.request_id] = event.finished.reason
                if len(finished) == 5:
                    await stream.done_sending()
    assert cancelled is not None and list(cancelled.cancelled) == ["long"]
    length, cancel = pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_CANCELLED
    assert finished == {f"s{i}": length for i in range(4)} | {"long": cancel}


def test_admin_through_nginx_is_permission_denied(nginx, checkpoint_b):
    with (
        Client(nginx.target, admin_token=ADMIN_TOKEN) as client,
        pytest.raises(grpc.RpcError) as err,
    ):
        client.update_weights(str(checkpoint_b))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "each replica at its own address" in (err.value.details() or "")


@pytest.mark.timeout(90)
async def test_update_weights_to_both_then_greedy_output_through_nginx_equals_hf(
    pair, nginx, checkpoint_b, capsys
):
    served = [r_info(r).policy_version for r in pair]
    # Only the first replica: requests that need its version converge on it by retrying.
    (first,) = await asyncio.to_thread(
        update_all, [pair[0].target], checkpoint_dir=str(checkpoint_b), admin_token=ADMIN_TOKEN
    )
    assert first.ok and first.applied is not None
    newer = first.applied.policy_version
    gated = await complete_all(
        nginx.target,
        [[0, 5, i] for i in range(6)],
        concurrency=1,
        max_tokens=2,
        min_policy_version=newer,
    )
    assert all(c.policy_versions == [newer, newer] for c in gated)

    token = pair[0].log_path.parent / "admin_token"
    argv = ["update-weights", "--checkpoint", str(checkpoint_b), "--admin-token-file", str(token)]
    for replica in pair:
        argv += ["--target", replica.target]
    assert await asyncio.to_thread(cli.main, argv) == 0
    report = json.loads(capsys.readouterr().out)
    version = max(*served, newer) + 1  # --version 0: one above the newest any replica serves
    assert [r["applied"]["policyVersion"] for r in report] == [str(version)] * 2
    assert [r_info(r).policy_version for r in pair] == [version] * 2

    prompts = [[0, 17, 42, 99, 123, 7], [0, 5, 6, 7, 8, 9, 10, 11], [0, 200, 3, 77]]
    done = await complete_all(nginx.target, prompts * 2, max_tokens=8, min_policy_version=version)
    expected = hf_greedy(checkpoint_b, prompts, 8)
    assert [c.token_ids for c in done] == expected * 2


def r_info(replica: ServerProcess):  # type: ignore[no-untyped-def]
    with Client(replica.target) as client:
        return client.info()


def hf_greedy(checkpoint: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    model = load_hf_model(checkpoint)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            ids = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,  # like ignore_eos: run to max_new_tokens
                pad_token_id=None,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.mark.timeout(90)
async def test_a_replica_killed_mid_run_leaves_requests_succeeding_through_the_other(
    tiny_llama, tmp_path
):
    assert NGINX is not None
    with (
        replicas(tmp_path, tiny_llama, 2) as (kept, killed),
        nginx_process(NGINX, tmp_path / "nginx", [kept.target, killed.target]) as front,
    ):
        async with AsyncClient(front.target) as client:

            async def one(i: int) -> str:
                try:
                    completion = await client.complete(
                        [0, 3, 4 + i], temperature=0.0, max_tokens=16, ignore_eos=True
                    )
                except grpc.aio.AioRpcError as err:
                    return err.code().name
                return completion.reason

            before = await asyncio.gather(*(one(i) for i in range(20)))
            in_flight = [asyncio.ensure_future(one(i)) for i in range(20, 28)]
            await asyncio.sleep(0.05)
            kill_group(killed)
            during = await asyncio.gather(*in_flight)
            after = await asyncio.gather(*(one(i) for i in range(28, 88)))
    assert before == ["LENGTH"] * 20, before
    # The calls in flight all ended (none hangs on the dead replica); one the dead replica had
    # already answered in part cannot move (its events were sent) and fails, with whatever
    # status gRPC makes of the broken stream, so `during` is not checked further. Every call
    # after the crash succeeds through the other replica.
    assert len(during) == 8
    assert after == ["LENGTH"] * 60, after
