"""Adapter versions through gRPC on a real engine: Admin LoadAdapter's `policy_version`,
`replace` and `inflight`; the version in every token chunk of an adapter's request;
min_policy_version compared with the adapter's version; AdapterInfo.policy_version. Tokens
are checked against peft's for the adapter version that produced them."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import admin_pb2_grpc, generation_pb2_grpc
from sluice.v1 import generation_pb2 as gpb
from sluice_client import Client, build_request, cli

from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model
from tests.support.service_harness import running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_TOKEN = "adm1n-s3cret"
PROMPT = [0, 17, 42, 99, 123, 7, 88, 5]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    made = {
        name: make_adapter(tiny_llama, root / name, r=8, seed=20 + i) for i, name in enumerate("ab")
    }
    made["too_wide"] = make_adapter(tiny_llama, root / "too_wide", r=32, seed=9)
    return made


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, dirs: dict[str, Path]) -> Any:
    @functools.cache
    def greedy(name: str) -> list[int]:
        return peft_greedy(peft_model(tiny_llama, dirs[name]), PROMPT, NEW_TOKENS)[0]

    return greedy


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path):  # type: ignore[no-untyped-def]
    async with running_server(
        tiny_llama,
        fake=False,
        engine={"max_loras": 2, "max_lora_rank": 16},
        admin_token=ADMIN_TOKEN,
    ) as running:
        yield running


def load(target: str, name: str, path: Path, **fields: Any) -> apb.AdapterInfo:
    request = apb.LoadAdapterRequest(name=name, path=str(path), **fields)
    with grpc.insecure_channel(target) as channel:
        response = admin_pb2_grpc.AdminStub(channel).LoadAdapter(
            request, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),), timeout=60
        )
    return response.adapter


def generate(target: str, adapter: str, **fields: Any) -> list[tuple[int, int]]:
    """(token, policy version) of each token of a greedy request."""
    request = build_request(
        PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, adapter=adapter
    )
    for name, value in fields.items():
        setattr(request, name, value)
    with grpc.insecure_channel(target) as channel:
        events = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    assert events[-1].finished.reason == gpb.FINISH_REASON_LENGTH
    return [
        (t, e.tokens.policy_version)
        for e in events
        if e.WhichOneof("event") == "tokens"
        for t in e.tokens.token_ids
    ]


def listed_versions(target: str) -> dict[str, int]:
    with Client(target) as client:
        return {a.name: a.policy_version for a in client.info().adapters}


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failed:
        call()
    return failed.value.code()


async def test_an_adapters_version_is_in_its_chunks_and_a_replace_raises_it(
    server, dirs, reference
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    info = await asyncio.to_thread(load, target, "v", dirs["a"], policy_version=5)
    assert info.policy_version == 5
    got = await asyncio.to_thread(generate, target, "v")
    assert [t for t, _ in got] == reference("a") and {v for _, v in got} == {5}
    with Client(target, admin_token=ADMIN_TOKEN) as client:
        info = await asyncio.to_thread(
            client.load_adapter, "v", str(dirs["b"]), replace=True, inflight="abort"
        )
    assert info.policy_version == 6 and info.path == str(dirs["b"])
    assert (await asyncio.to_thread(listed_versions, target))["v"] == 6
    got = await asyncio.to_thread(generate, target, "v")
    assert [t for t, _ in got] == reference("b") and {v for _, v in got} == {6}


async def test_min_policy_version_compares_with_the_adapters_version(server, dirs) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(load, target, "m", dirs["a"], policy_version=3)
    with pytest.raises(grpc.RpcError) as early:
        await asyncio.to_thread(generate, target, "m", min_policy_version=4)
    assert early.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "policy version 3 of adapter 'm'" in (early.value.details() or "")
    await asyncio.to_thread(load, target, "m", dirs["b"], replace=True, policy_version=4)
    got = await asyncio.to_thread(generate, target, "m", min_policy_version=4)
    assert {v for _, v in got} == {4}


async def test_a_replace_that_cannot_be_done_changes_nothing(server, dirs, reference) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(load, target, "f", dirs["a"], policy_version=2)
    before = await asyncio.to_thread(listed_versions, target)
    cases = [
        ("f", dirs["b"], 2, grpc.StatusCode.FAILED_PRECONDITION),  # not newer
        ("f", dirs["too_wide"], 0, grpc.StatusCode.INVALID_ARGUMENT),  # rank 32 > 16
        ("nobody", dirs["b"], 0, grpc.StatusCode.NOT_FOUND),
    ]
    for name, path, version, code in cases:
        call = functools.partial(load, target, name, path, replace=True, policy_version=version)
        assert await asyncio.to_thread(code_of, call) == code
    assert await asyncio.to_thread(listed_versions, target) == before
    got = await asyncio.to_thread(generate, target, "f")
    assert [t for t, _ in got] == reference("a") and {v for _, v in got} == {2}
    code = await asyncio.to_thread(code_of, functools.partial(load, target, "f", dirs["b"]))
    assert code == grpc.StatusCode.ALREADY_EXISTS  # without `replace`


async def test_continue_switches_a_running_requests_version_at_the_swap(server, dirs) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(load, target, "c", dirs["a"])
    request = build_request(PROMPT, max_tokens=400, ignore_eos=True, adapter="c")
    async with grpc.aio.insecure_channel(target) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request)
        versions = []
        while not versions:  # its first tokens, on version 1
            event = await call.read()
            if event.WhichOneof("event") == "tokens":
                versions.append(event.tokens.policy_version)
        fields = {"replace": True, "inflight": apb.INFLIGHT_POLICY_CONTINUE}
        await asyncio.to_thread(load, target, "c", dirs["b"], **fields)
        finished = None
        while finished is None:
            event = await call.read()
            if event.WhichOneof("event") == "tokens":
                versions.append(event.tokens.policy_version)
            elif event.WhichOneof("event") == "finished":
                finished = event.finished
    assert finished is not None and finished.reason == gpb.FINISH_REASON_LENGTH
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)


async def test_the_cli_replaces_an_adapter_under_a_version(server, dirs, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    flags = ["--target", target, "--admin-token-file", str(token)]
    assert await asyncio.to_thread(cli.main, ["adapters", "load", "k", str(dirs["a"]), *flags]) == 0
    assert json.loads(capsys.readouterr().out)["policyVersion"] == "1"
    argv = ["adapters", "load", "k", str(dirs["b"]), "--replace", "--policy-version", "9"]
    argv += ["--inflight", "continue", *flags]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert json.loads(capsys.readouterr().out)["policyVersion"] == "9"
    assert (await asyncio.to_thread(listed_versions, target))["k"] == 9
