"""The clients' pieces for replicas: the affinity key on the wire, and one weight update pushed
to several replicas (`update_all`, `sluice update-weights --target A --target B`), against
servers on the fake engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import generation_pb2 as pb
from sluice_client import AFFINITY_KEY, AsyncClient, Client, cli, update_all

from tests.support.service_harness import make_fake_model, running_server

in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop the replicas run on

ADMIN_TOKEN = "replicas-admin"
OTHER_TOKEN = "another-admin"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas(tmp_path_factory) -> AsyncIterator[list[str]]:
    """Two replicas with the admin token, a third with another one (its updates are refused)."""
    models = [make_fake_model(tmp_path_factory.mktemp(f"fake{i}")) for i in range(3)]
    async with (
        running_server(models[0], admin_token=ADMIN_TOKEN) as (_, first),
        running_server(models[1], admin_token=ADMIN_TOKEN) as (_, second),
        running_server(models[2], admin_token=OTHER_TOKEN) as (_, refusing),
    ):
        yield [first, second, refusing]


def versions(targets: list[str]) -> list[int]:
    out = []
    for target in targets:
        with Client(target) as client:
            out.append(client.info().policy_version)
    return out


class MetadataSeen:
    """A Generation server that records each call's metadata and answers with one `finished`."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    async def generate(self, request, context):  # type: ignore[no-untyped-def]
        self.seen.append(dict(context.invocation_metadata()))
        yield pb.GenerateResponse(finished=pb.Finished(reason=pb.FINISH_REASON_LENGTH))

    async def cancel(self, request, context) -> pb.CancelResponse:  # type: ignore[no-untyped-def]
        self.seen.append(dict(context.invocation_metadata()))
        return pb.CancelResponse()


@in_module_loop
async def test_the_affinity_key_is_sent_per_client_and_per_call():
    recorder = MetadataSeen()
    handler = grpc.method_handlers_generic_handler(
        "sluice.v1.Generation",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                recorder.generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
            "Cancel": grpc.unary_unary_rpc_method_handler(
                recorder.cancel,
                request_deserializer=pb.CancelRequest.FromString,
                response_serializer=pb.CancelResponse.SerializeToString,
            ),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with AsyncClient(target, affinity="conv-1", api_token="t") as client:
            await client.complete([0, 1])
            await client.complete([0, 1], affinity="conv-2")  # the call's own key wins
            await client.complete([0, 1], affinity="")  # none for this call
            await client.cancel(["x"])
        with Client(target) as sync_client:
            await asyncio.to_thread(sync_client.complete, [0, 1])
            await asyncio.to_thread(sync_client.complete, [0, 1], affinity="group-9")
            await asyncio.to_thread(sync_client.cancel, ["x"], affinity="group-9")
    finally:
        await server.stop(None)
    keys = [seen.get(AFFINITY_KEY) for seen in recorder.seen]
    assert keys == ["conv-1", "conv-2", None, "conv-1", None, "group-9", "group-9"]
    assert all(seen["authorization"] == "Bearer t" for seen in recorder.seen[:4])


@pytest.mark.parametrize("bad", ["has space", "naïve", "x" * 257, "tab\tkey"])
def test_an_affinity_key_that_cannot_travel_as_a_header_is_a_value_error(bad):
    with pytest.raises(ValueError, match="affinity"):
        Client("127.0.0.1:1", affinity=bad)


@in_module_loop
async def test_update_all_brings_every_replica_to_one_version(replicas):
    pair = replicas[:2]
    with Client(pair[0], admin_token=ADMIN_TOKEN) as ahead:  # the replicas start apart
        await asyncio.to_thread(ahead.update_weights, "/ckpt/ahead")
    start = await asyncio.to_thread(versions, pair)
    seen: list[tuple[str, str]] = []
    results = await asyncio.to_thread(
        update_all,
        pair,
        checkpoint_dir="/ckpt/next",
        admin_token=ADMIN_TOKEN,
        on_progress=lambda target, event: seen.append((target, str(event.WhichOneof("event")))),
    )
    version = max(start) + 1
    assert [(r.target, r.ok, r.code) for r in results] == [(t, True, "OK") for t in pair]
    assert [r.applied.policy_version for r in results if r.applied] == [version] * 2
    assert await asyncio.to_thread(versions, pair) == [version] * 2
    for target in pair:
        assert [e for t, e in seen if t == target][-1] == "applied"


@in_module_loop
async def test_a_replica_that_refuses_keeps_its_version_and_the_others_update(replicas):
    start = await asyncio.to_thread(versions, replicas)
    results = await asyncio.to_thread(
        update_all,
        replicas,
        checkpoint_dir="/ckpt/n",
        admin_token=ADMIN_TOKEN,
        policy_version=max(start) + 5,
    )
    assert [r.ok for r in results] == [True, True, False]
    assert results[2].code == "UNAUTHENTICATED" and results[2].applied is None
    assert await asyncio.to_thread(versions, replicas) == [max(start) + 5] * 2 + [start[2]]


@in_module_loop
async def test_cli_updates_several_targets_and_exits_1_when_one_failed(replicas, tmp_path, capsys):
    token = tmp_path / "admin_token"
    token.write_text(ADMIN_TOKEN)
    argv = ["update-weights", "--checkpoint", "/ckpt/cli", "--admin-token-file", str(token)]
    for target in replicas:
        argv += ["--target", target]
    start = await asyncio.to_thread(versions, replicas)
    assert await asyncio.to_thread(cli.main, argv) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    version = max(start) + 1
    assert [r["target"] for r in report] == replicas
    assert [r["applied"]["policyVersion"] for r in report[:2]] == [str(version)] * 2
    assert report[2]["error"]["code"] == "UNAUTHENTICATED"
    assert f"{replicas[0]}: applied: version" in err and f"{replicas[2]}: UNAUTHENTICATED" in err

    assert await asyncio.to_thread(cli.main, argv[:-2]) == 0  # the two that accept
    assert [r["applied"]["policyVersion"] for r in json.loads(capsys.readouterr().out)] == [
        str(version + 1)
    ] * 2


def test_update_all_refuses_a_target_listed_twice_and_a_missing_source():
    with pytest.raises(ValueError, match="twice"):
        update_all(["a:1", "a:1"], checkpoint_dir="/x")
    with pytest.raises(ValueError, match="exactly one source"):
        update_all(["a:1"])
