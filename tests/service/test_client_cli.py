"""The `sluice` command's client verbs (sluice_client.cli) against a server on the fake engine."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
from service_harness import make_fake_model, running_server
from sluice_client import AsyncClient, cli, pb

pytestmark = pytest.mark.asyncio(loop_scope="module")
HOLD = 300  # a prompt holding this token stays queued until cancelled


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), hold_token=HOLD)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(model_dir):
    async with running_server(model_dir) as (_, target):
        yield target


async def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_tokenize_prints_the_ids_the_server_gives(target, capsys):
    code, out, _ = await run(capsys, "tokenize", "--target", target, "hello world")
    async with AsyncClient(target) as client:
        expected = await client.tokenize("hello world")
    assert code == 0 and json.loads(out) == expected and expected


async def test_cancel_ends_a_request_started_on_another_connection(target, capsys):
    async with AsyncClient(target) as client:
        events = client.generate([5, HOLD, 7], request_id="held-1", max_tokens=4)
        first = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.2)  # the request reaches the server
        code, out, _ = await run(capsys, "cancel", "--target", target, "held-1", "never-was")
        assert (await first).WhichOneof("event") == "started"
        assert code == 0
        assert json.loads(out) == {"cancelled": ["held-1"], "not_found": ["never-was"]}
        last = [event async for event in events][-1]
    assert last.finished.reason == pb.FINISH_REASON_CANCELLED


async def test_generate_info_and_health_verbs(target, capsys):
    code, out, err = await run(capsys, "generate", "--target", target, "abc", "--max-tokens", "3")
    assert code == 0 and out.startswith("abc") and "[FINISH_REASON_LENGTH]" in err
    code, out, _ = await run(capsys, "info", "--target", target)
    assert code == 0 and json.loads(out)["state"] == "SERVING_STATE_SERVING"
    code, out, _ = await run(capsys, "health", "--target", target)
    assert code == 0 and out.endswith("SERVING\n")


async def test_a_failed_call_is_one_line_and_exit_1(target, capsys):
    code, out, err = await run(capsys, "tokenize", "--target", "127.0.0.1:1", "x")
    assert code == 1 and out == "" and err.startswith("UNAVAILABLE: ")
