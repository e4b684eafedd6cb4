"""LoRA adapters through gRPC on a real engine: Admin LoadAdapter then Generate with the adapter
gives peft's greedy ids and logprobs for it; every status code of LoadAdapter, UnloadAdapter and
an unknown adapter; ServerInfo.adapters; per-adapter metrics; the adapters replayed into a
restarted engine; the CLI verbs."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import generation_pb2_grpc
from sluice_client import Client, build_request, cli

from tests.support.adapter_calls import (
    ADMIN_TOKEN,
    NEW_TOKENS,
    PROMPT,
    admin_call,
    assert_same_as_peft,
    complete,
    listed,
    refusal,
)
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model
from tests.support.service_harness import running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPECS: dict[str, dict[str, Any]] = {
    "a": {"r": 8, "alpha": 16},
    "b": {"r": 4, "alpha": 8, "use_rslora": True, "targets": ("q_proj", "v_proj", "down_proj")},
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {
        name: make_adapter(tiny_llama, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(SPECS.items())
    }
    dirs["too_wide"] = make_adapter(tiny_llama, root / "too_wide", r=32, seed=9)
    return dirs


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, adapter_dirs: dict[str, Path]) -> Any:
    """Adapter name ("" = the base model) -> peft's greedy ids and logprobs of PROMPT."""

    @functools.cache
    def greedy(name: str) -> tuple[list[int], list[float]]:
        model = peft_model(tiny_llama, adapter_dirs[name] if name else None)
        return peft_greedy(model, PROMPT, NEW_TOKENS)

    return greedy


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path):  # type: ignore[no-untyped-def]
    async with running_server(
        tiny_llama,
        fake=False,
        engine={"max_loras": 2, "max_lora_rank": 16},
        admin_token=ADMIN_TOKEN,
        restart_backoff=0.1,
    ) as running:
        yield running


def load(target: str, name: str, path: Path, pinned: bool = False) -> apb.LoadAdapterResponse:
    request = apb.LoadAdapterRequest(name=name, path=str(path), pinned=pinned)
    return admin_call(target, "LoadAdapter", request)


async def test_generate_with_a_loaded_adapter_gives_peft_tokens(
    server, adapter_dirs, reference
) -> None:  # type: ignore[no-untyped-def]
    running, target = server
    loaded = await asyncio.to_thread(load, target, "a", adapter_dirs["a"])
    assert (loaded.adapter.name, loaded.adapter.rank, loaded.adapter.resident) == ("a", 8, True)
    with Client(target, admin_token=ADMIN_TOKEN) as client:
        info = await asyncio.to_thread(client.load_adapter, "b", str(adapter_dirs["b"]))
    assert list(info.target_modules) == ["q_proj", "v_proj", "down_proj"]
    assert info.scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    for name in ("a", "b", ""):
        got = await asyncio.to_thread(complete, target, name)
        assert_same_as_peft(got, await asyncio.to_thread(reference, name))
    base = reference("")[0]
    assert reference("a")[0] != base and reference("b")[0] != base  # the adapters matter
    registry = running.metrics.registry
    for name in ("a", "b"):
        labels = {"adapter": name}
        assert registry.get_sample_value("sluice_adapter_requests_total", labels) == 1
        tokens = registry.get_sample_value("sluice_adapter_generation_tokens_total", labels)
        assert tokens == NEW_TOKENS
    adapters = await asyncio.to_thread(listed, target)
    assert list(adapters) == ["a", "b"]
    assert adapters["a"].path == str(adapter_dirs["a"]) and not adapters["a"].pinned
    assert len(adapters["a"].target_modules) == 7


async def test_an_unknown_adapter_is_not_found_naming_adapter(server) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    with Client(target, retry=False) as client:
        code, fields = await asyncio.to_thread(
            refusal, lambda: client.complete(PROMPT, max_tokens=2, adapter="nope")
        )
    assert (code, fields) == (grpc.StatusCode.NOT_FOUND, ["adapter"])


@pytest.mark.parametrize(
    ("name", "which", "code", "fields"),
    [
        ("", "a", grpc.StatusCode.INVALID_ARGUMENT, ["name"]),
        ("x" * 257, "a", grpc.StatusCode.INVALID_ARGUMENT, ["name"]),
        ("wide", "too_wide", grpc.StatusCode.INVALID_ARGUMENT, ["path"]),  # rank 32 > 16
        ("missing", None, grpc.StatusCode.INVALID_ARGUMENT, ["path"]),
        ("a", "b", grpc.StatusCode.ALREADY_EXISTS, []),
    ],
)
async def test_a_load_that_cannot_be_done_changes_nothing(
    server, adapter_dirs, tiny_llama, name, which, code, fields
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(_ensure_loaded, target, adapter_dirs, "a")
    before = await asyncio.to_thread(listed, target)
    path = adapter_dirs[which] if which else tiny_llama / "no_such_adapter"
    got = await asyncio.to_thread(refusal, lambda: load(target, name, path))
    assert got == (code, fields)
    assert await asyncio.to_thread(listed, target) == before


async def test_the_wide_adapter_message_names_the_rank(server, adapter_dirs) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    with pytest.raises(grpc.RpcError) as failed:
        await asyncio.to_thread(load, target, "wide", adapter_dirs["too_wide"])
    assert "rank 32 is above max_lora_rank=16" in (failed.value.details() or "")


async def test_pinning_every_slot_is_failed_precondition(server, adapter_dirs) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(_ensure_unloaded, target, "pin1", "pin2")
    assert (await asyncio.to_thread(load, target, "pin1", adapter_dirs["b"], True)).adapter.pinned
    got = await asyncio.to_thread(refusal, lambda: load(target, "pin2", adapter_dirs["b"], True))
    assert got[0] == grpc.StatusCode.FAILED_PRECONDITION
    await asyncio.to_thread(_ensure_unloaded, target, "pin1")


async def test_unload_forgets_the_adapter_and_an_unknown_name_is_not_found(
    server, adapter_dirs
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(_ensure_loaded, target, adapter_dirs, "b")
    await asyncio.to_thread(admin_call, target, "UnloadAdapter", apb.UnloadAdapterRequest(name="b"))
    assert "b" not in await asyncio.to_thread(listed, target)
    with Client(target, retry=False) as client:
        code, _ = await asyncio.to_thread(
            refusal, lambda: client.complete(PROMPT, max_tokens=2, adapter="b")
        )
    assert code == grpc.StatusCode.NOT_FOUND
    got = await asyncio.to_thread(
        refusal, lambda: admin_call(target, "UnloadAdapter", apb.UnloadAdapterRequest(name="b"))
    )
    assert got[0] == grpc.StatusCode.NOT_FOUND


async def test_unload_while_a_request_runs_the_adapter_is_failed_precondition(
    server, adapter_dirs
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(_ensure_loaded, target, adapter_dirs, "a")
    request = build_request(PROMPT, max_tokens=400, ignore_eos=True, adapter="a")
    async with grpc.aio.insecure_channel(target) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request)
        first = await call.read()  # started: the engine runs it
        assert first.WhichOneof("event") == "started"
        unload = apb.UnloadAdapterRequest(name="a")
        got = await asyncio.to_thread(refusal, lambda: admin_call(target, "UnloadAdapter", unload))
        call.cancel()
    assert got[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "a" in await asyncio.to_thread(listed, target)


async def test_the_lora_info_gauge_names_the_running_requests_adapter(server, adapter_dirs) -> None:  # type: ignore[no-untyped-def]
    """sluice_lora_requests_info: what llm-d's scheduler reads as vLLM's lora_requests_info."""
    running, target = server
    await asyncio.to_thread(_ensure_loaded, target, adapter_dirs, "a")
    registry = running.metrics.registry

    def info(adapters: str) -> float | None:
        labels = {"running_lora_adapters": adapters, "waiting_lora_adapters": ""}
        return registry.get_sample_value("sluice_lora_requests_info", labels | {"max_lora": "2"})

    request = build_request(PROMPT, max_tokens=400, ignore_eos=True, adapter="a")
    async with grpc.aio.insecure_channel(target) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request)
        assert (await call.read()).WhichOneof("event") == "started"
        await call.read()  # a token: a step ran it, and its stats name the adapter
        async with asyncio.timeout(10):  # the next step's message says so
            while running.engine.stats.running_adapters != ("a",):
                await asyncio.sleep(0.01)
        assert info("a") is not None and info("a") > time.time() - 60
        call.cancel()
    async with asyncio.timeout(10):
        while running.engine.stats.running:
            await asyncio.sleep(0.01)
    assert info("") is not None  # no adapter runs now


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_adapter_calls_need_the_admin_token(server, adapter_dirs, token) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    for method, request in (
        ("LoadAdapter", apb.LoadAdapterRequest(name="t", path=str(adapter_dirs["a"]))),
        ("UnloadAdapter", apb.UnloadAdapterRequest(name="a")),
    ):
        got = await asyncio.to_thread(
            refusal, lambda m=method, r=request: admin_call(target, m, r, token)
        )
        assert got[0] == grpc.StatusCode.UNAUTHENTICATED


async def test_the_cli_verbs_load_list_generate_and_unload(
    server, adapter_dirs, tmp_path, capsys
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(_ensure_unloaded, target, "cli")
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    flags = ["--target", target, "--admin-token-file", str(token)]
    argv = ["adapters", "load", "cli", str(adapter_dirs["b"]), *flags]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert json.loads(capsys.readouterr().out)["rank"] == 4
    assert await asyncio.to_thread(cli.main, ["adapters", "list", "--target", target]) == 0
    assert "cli" in [a["name"] for a in json.loads(capsys.readouterr().out)]
    argv = ["generate", "hi", "--target", target, "--adapter", "nope", "--max-tokens", "2"]
    assert await asyncio.to_thread(cli.main, argv) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    argv = ["generate", "hi", "--target", target, "--adapter", "cli", "--max-tokens", "2"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert await asyncio.to_thread(cli.main, ["adapters", "unload", "cli", *flags]) == 0
    assert "cli" not in await asyncio.to_thread(listed, target)
    argv = ["adapters", "unload", "cli", "--target", target]
    assert await asyncio.to_thread(cli.main, argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


async def test_a_restarted_engine_loads_the_adapters_again_but_not_a_changed_one(
    server, adapter_dirs, reference, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    running, target = server
    await asyncio.to_thread(_ensure_loaded, target, adapter_dirs, "a")
    before = set(await asyncio.to_thread(listed, target))
    gone = shutil.copytree(adapter_dirs["b"], tmp_path / "gone")
    await asyncio.to_thread(load, target, "gone", gone)
    shutil.rmtree(gone)  # its directory vanishes: not loaded again under its name
    restarts = running.engine.restarts
    engine = running.engine.engine
    assert engine is not None
    os.kill(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while running.engine.restarts == restarts or running.engine.state.value != "serving":
        assert time.monotonic() < deadline, "the engine did not come back"
        await asyncio.sleep(0.1)
    assert set(await asyncio.to_thread(listed, target)) == before
    got = await asyncio.to_thread(complete, target, "a")
    assert_same_as_peft(got, await asyncio.to_thread(reference, "a"))


async def test_adapter_calls_while_asleep_are_failed_precondition(server, adapter_dirs) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(admin_call, target, "Sleep", apb.SleepRequest(level=1))
    try:
        load_got = await asyncio.to_thread(refusal, lambda: load(target, "z", adapter_dirs["b"]))
        unload = apb.UnloadAdapterRequest(name="a")
        unload_got = await asyncio.to_thread(
            refusal, lambda: admin_call(target, "UnloadAdapter", unload)
        )
    finally:
        await asyncio.to_thread(admin_call, target, "Wake", apb.WakeRequest())
    assert load_got[0] == unload_got[0] == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_server_without_lora_slots_refuses_loads(tiny_llama, adapter_dirs) -> None:  # type: ignore[no-untyped-def]
    async with running_server(tiny_llama, fake=False, admin_token=ADMIN_TOKEN) as (_, target):
        got = await asyncio.to_thread(refusal, lambda: load(target, "a", adapter_dirs["a"]))
        assert got[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert await asyncio.to_thread(listed, target) == {}


def _ensure_loaded(target: str, dirs: dict[str, Path], name: str) -> None:
    if name not in listed(target):
        load(target, name, dirs[name])


def _ensure_unloaded(target: str, *names: str) -> None:
    for name in names:
        if name in listed(target):
            admin_call(target, "UnloadAdapter", apb.UnloadAdapterRequest(name=name))
