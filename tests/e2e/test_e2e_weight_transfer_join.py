"""End to end: Admin.InitWeightTransfer against a trainer address that never answers (a
listener that accepts and stays silent) or where nothing listens. The call ends UNAVAILABLE
at its timeout_ms while a concurrent Generate completes at once, and the engine serves on
under the same pid (not replaced by the stall timeout).

Admin calls of the test itself use the synchronous client in a thread (grpc/grpc#36066).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice_client import AsyncClient, Client, build_request

from tests.support.service_harness import running_server
from tests.support.silent_listener import SilentListener, refused_port

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ADMIN_TOKEN = "e2e-admin"
PROMPT = [0, 17, 42, 99, 123, 7]
SLACK_S = 1.5  # the engine answers at its first loop iteration past the deadline


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tiny_llama: Path):
    server = running_server(tiny_llama, fake=False, admin_token=ADMIN_TOKEN)
    async with server as (s, t):
        yield s, t


def join_request(port: int, timeout_ms: int) -> apb.InitWeightTransferRequest:
    return apb.InitWeightTransferRequest(
        master_address="127.0.0.1",
        master_port=port,
        world_size=2,
        rank_offset=1,
        group_name="g",
        timeout_ms=timeout_ms,
    )


async def init_weight_transfer(t: str, request: apb.InitWeightTransferRequest) -> grpc.RpcError:
    """The call's error (it must fail)."""
    with Client(t, admin_token=ADMIN_TOKEN) as admin, pytest.raises(grpc.RpcError) as failed:
        await asyncio.to_thread(admin.init_weight_transfer, request, timeout=60)
    return failed.value


async def generated(t: str) -> list[int]:
    async with AsyncClient(t) as client:
        request = build_request(PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True)
        return list((await client.complete(request)).token_ids)


async def test_a_silent_trainer_fails_the_join_at_its_timeout_while_generation_goes_on(
    target,
) -> None:
    server, t = target
    expected = await generated(t)
    pid, restarts = server.engine.engine.pid, server.engine.restarts
    timeout_s = 5.0
    with SilentListener() as listener:
        began = time.monotonic()
        call = asyncio.create_task(
            init_weight_transfer(t, join_request(listener.port, int(timeout_s * 1000)))
        )
        assert await asyncio.to_thread(listener.accepted.wait, 30)  # the engine is in c10d
        assert await generated(t) == expected
        assert not call.done()  # generated while the join is under way
        error = await call
        call_s = time.monotonic() - began
    assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()
    assert "could not join the weight-transfer group" in (error.details() or "")
    assert timeout_s <= call_s < timeout_s + SLACK_S, call_s
    assert (server.engine.engine.pid, server.engine.restarts) == (pid, restarts)
    assert server.engine.state.value == "serving" and await generated(t) == expected


async def test_nothing_listening_fails_the_join_at_its_timeout(target) -> None:
    server, t = target
    pid = server.engine.engine.pid
    with refused_port() as port:
        began = time.monotonic()
        error = await init_weight_transfer(t, join_request(port, 2000))
        call_s = time.monotonic() - began
    assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()
    assert 2.0 <= call_s < 2.0 + SLACK_S, call_s
    assert server.engine.engine.pid == pid
