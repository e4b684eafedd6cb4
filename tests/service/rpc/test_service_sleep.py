"""Admin Sleep and Wake over gRPC, against a real engine process on the tiny checkpoint:
the states callers see (health, GetServerInfo, refusals with a retry delay), the field checks,
auth, the CLI verbs, and a restarted engine staying asleep."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import admin_pb2_grpc
from sluice.v1 import generation_pb2 as pb
from sluice_client import Client, cli

from tests.support.service_harness import health_status, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_TOKEN = "adm1n-s3cret"
PROMPT = [0, 17, 42, 99, 123, 7, 88, 5]
SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING,
    health_pb2.HealthCheckResponse.NOT_SERVING,
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path):  # type: ignore[no-untyped-def]
    async with running_server(
        tiny_llama, fake=False, admin_token=ADMIN_TOKEN, restart_backoff=0.1, retry_after=0.5
    ) as running:
        yield running


def info(target: str) -> pb.ServerInfo:
    with Client(target) as client:
        return client.info()


def greedy_ids(target: str) -> list[int]:
    with Client(target, retry=False) as client:
        done = client.complete(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        return list(done.token_ids)


def admin_call(target: str, method: str, request: object, token: str | None = ADMIN_TOKEN):  # type: ignore[no-untyped-def]
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(target) as channel:
        return getattr(admin_pb2_grpc.AdminStub(channel), method)(
            request, metadata=metadata, timeout=60
        )


def refusal(call) -> tuple[grpc.StatusCode, list[str], int | None]:  # type: ignore[no-untyped-def]
    """(status code, BadRequest fields, RetryInfo delay in ms) of a failed call."""
    with pytest.raises(grpc.RpcError) as failed:
        call()
    fields, delay = [], None
    status = rpc_status.from_call(failed.value)
    for detail in status.details if status else []:
        bad, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
        elif detail.Unpack(retry):
            delay = retry.retry_delay.ToMilliseconds()
    return failed.value.code(), fields, delay


async def test_asleep_the_server_refuses_generation_and_is_not_serving_until_wake(server) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    before = await asyncio.to_thread(greedy_ids, target)
    response = await asyncio.to_thread(admin_call, target, "Sleep", apb.SleepRequest(level=2))
    assert response.level == 2 and response.released_bytes > 0
    async with grpc.aio.insecure_channel(target) as channel:
        for service in ("", "sluice.v1.Generation"):
            assert await health_status(channel, service) == NOT_SERVING
    # NOTE: sync calls run in threads: the server shares this event loop.
    assert (await asyncio.to_thread(info, target)).state == pb.SERVING_STATE_SLEEPING
    with Client(target, retry=False) as client:
        assert await asyncio.to_thread(client.tokenize, "Hello world")  # still answers
        code, _, delay = await asyncio.to_thread(
            refusal, lambda: client.complete(PROMPT, max_tokens=4)
        )
    assert code == grpc.StatusCode.UNAVAILABLE and delay is not None and delay >= 500
    woke = await asyncio.to_thread(admin_call, target, "Wake", apb.WakeRequest())
    assert woke.reloaded and woke.policy_version == 0
    async with grpc.aio.insecure_channel(target) as channel:
        assert await health_status(channel, "sluice.v1.Generation") == SERVING
    assert await asyncio.to_thread(greedy_ids, target) == before


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (apb.SleepRequest(level=3), "level"),
        (apb.SleepRequest(inflight=apb.INFLIGHT_POLICY_CONTINUE), "inflight"),
        (apb.SleepRequest(inflight=apb.INFLIGHT_POLICY_RECOMPUTE), "inflight"),
    ],
)
async def test_a_bad_field_is_invalid_argument_naming_it(server, request_, field) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    code, fields, _ = await asyncio.to_thread(
        refusal, lambda: admin_call(target, "Sleep", request_)
    )
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, [field])
    assert (await asyncio.to_thread(info, target)).state == pb.SERVING_STATE_SERVING


@pytest.mark.parametrize(
    ("token", "code"),
    [(None, grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED)],
)
async def test_sleep_and_wake_need_the_admin_token(server, token, code) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    for method, request in (("Sleep", apb.SleepRequest()), ("Wake", apb.WakeRequest())):
        got, _, _ = await asyncio.to_thread(
            refusal, lambda m=method, r=request: admin_call(target, m, r, token)
        )
        assert got == code
    assert (await asyncio.to_thread(info, target)).state == pb.SERVING_STATE_SERVING


async def test_the_cli_verbs_sleep_and_wake_print_the_responses(server, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    flags = ["--target", target, "--admin-token-file", str(token)]
    assert await asyncio.to_thread(cli.main, ["sleep", "--inflight", "abort", *flags]) == 0
    slept = json.loads(capsys.readouterr().out)
    assert slept["level"] == 1 and int(slept["releasedBytes"]) > 0
    assert await asyncio.to_thread(cli.main, ["wake", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["reloaded"] is False
    assert await asyncio.to_thread(cli.main, ["sleep", "--level", "2", "--target", target]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


async def test_the_cli_names_the_remedy_for_sleep_a_missing_token_and_no_lora_slots(
    server, tmp_path, capsys
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    admin = ["--target", target, "--admin-token-file", str(token)]
    assert await asyncio.to_thread(cli.main, ["sleep", "--target", target]) == 1
    err = capsys.readouterr().err
    assert "missing or invalid admin token" in err and "--admin-token-file FILE" in err
    assert await asyncio.to_thread(cli.main, ["adapters", "load", "a", str(tmp_path), *admin]) == 1
    err = capsys.readouterr().err
    assert "max_loras is 0" in err and "restart the server with `--max-loras N`" in err
    assert await asyncio.to_thread(cli.main, ["sleep", *admin]) == 0
    try:
        argv = ["generate", "--target", target, "--max-tokens", "2", "hi"]
        assert await asyncio.to_thread(cli.main, argv) == 1
        err = capsys.readouterr().err
        assert "the engine is sleeping" in err and f"`sluice wake --target {target}" in err
    finally:
        assert await asyncio.to_thread(cli.main, ["wake", *admin]) == 0


async def test_a_restarted_engine_comes_back_asleep_and_wakes_with_the_same_weights(server) -> None:  # type: ignore[no-untyped-def]
    running, target = server
    before = await asyncio.to_thread(greedy_ids, target)
    with Client(target, admin_token=ADMIN_TOKEN) as admin:
        await asyncio.to_thread(admin.sleep, 2)
    restarts = running.engine.restarts
    engine = running.engine.engine
    assert engine is not None
    os.kill(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while running.engine.restarts == restarts or running.engine.stats.sleep_level != 2:
        assert time.monotonic() < deadline, "the engine did not come back asleep"
        await asyncio.sleep(0.1)
        if running.engine.restarts > restarts:
            await running.engine.refresh_stats()
    assert running.engine.state.value == "sleeping"
    assert (await asyncio.to_thread(info, target)).state == pb.SERVING_STATE_SLEEPING
    with Client(target, admin_token=ADMIN_TOKEN) as admin:
        assert (await asyncio.to_thread(admin.wake)).reloaded
    assert await asyncio.to_thread(greedy_ids, target) == before
