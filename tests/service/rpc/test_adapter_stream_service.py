"""Admin LoadAdapterStream on a real engine: an adapter streamed as torch tensors or from its
safetensors file gives the same greedy ids and logprobs as the same adapter loaded from its
directory and as peft's model; bad streams are refused with the code and the BadRequest field
that name what is wrong, and change nothing (no adapter, no spool left in --weights-dir); the
spool serves an engine restart and goes when the adapter is unloaded or replaced."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice_client import Client
from sluice_client.adapter_stream import adapter_chunks

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


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream_adapters")
    return {
        "a": make_adapter(tiny_llama, root / "a", r=8, alpha=16, seed=3),
        "b": make_adapter(tiny_llama, root / "b", r=4, targets=("q_proj", "v_proj"), seed=4),
        "wide": make_adapter(tiny_llama, root / "wide", r=32, seed=5),
    }


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, adapter_dirs: dict[str, Path]) -> Any:
    @functools.cache
    def greedy(name: str) -> tuple[list[int], list[float]]:
        return peft_greedy(peft_model(tiny_llama, adapter_dirs[name]), PROMPT, NEW_TOKENS)

    return greedy


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights_dir")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama: Path, weights_dir: Path):  # type: ignore[no-untyped-def]
    async with running_server(
        tiny_llama,
        fake=False,
        engine={"max_loras": 2, "max_lora_rank": 16},
        admin_token=ADMIN_TOKEN,
        weights_dir=str(weights_dir),
        restart_backoff=0.1,
    ) as running:
        yield running


def config_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "adapter_config.json").read_text())


def torch_tensors(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def stream(target: str, name: str, directory: Path, **options: Any) -> apb.AdapterInfo:
    with Client(target, admin_token=ADMIN_TOKEN) as client:
        return client.load_adapter_tensors(
            name, config_of(directory), torch_tensors(directory), **options
        )


def send(target: str, messages: list[apb.LoadAdapterStreamRequest]) -> apb.LoadAdapterResponse:
    return admin_call(target, "LoadAdapterStream", iter(messages))


def unload(target: str, *names: str) -> None:
    for name in names:
        if name in listed(target):
            admin_call(target, "UnloadAdapter", apb.UnloadAdapterRequest(name=name))


def spools(weights_dir: Path) -> list[str]:
    return sorted(p.name for p in weights_dir.iterdir())


def good_chunks(directory: Path, name: str = "bad") -> list[apb.LoadAdapterStreamRequest]:
    return list(adapter_chunks(name, config_of(directory), torch_tensors(directory)))


async def test_a_streamed_adapter_gives_the_tokens_of_its_directory_and_of_peft(
    server, adapter_dirs, reference, weights_dir
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    info = await asyncio.to_thread(stream, target, "streamed", adapter_dirs["a"])
    assert (info.name, info.rank, info.resident) == ("streamed", 8, True)
    assert Path(info.path).parent == weights_dir and spools(weights_dir) == [Path(info.path).name]
    with Client(target, admin_token=ADMIN_TOKEN) as client:
        await asyncio.to_thread(client.load_adapter, "from_dir", str(adapter_dirs["a"]))
    streamed = await asyncio.to_thread(complete, target, "streamed")
    from_dir = await asyncio.to_thread(complete, target, "from_dir")
    want = await asyncio.to_thread(reference, "a")
    assert streamed == from_dir
    assert_same_as_peft(streamed, want)
    await asyncio.to_thread(unload, target, "streamed", "from_dir")
    assert spools(weights_dir) == []  # unloading deletes the spool


async def test_an_adapter_streamed_from_its_safetensors_file_in_small_chunks(
    server, adapter_dirs, reference, weights_dir
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    directory = adapter_dirs["b"]
    with Client(target, admin_token=ADMIN_TOKEN) as client:
        info = await asyncio.to_thread(
            client.load_adapter_tensors,
            "file",
            (directory / "adapter_config.json").read_text(),
            directory / "adapter_model.safetensors",
            chunk_bytes=1000,
            policy_version=7,
        )
    assert (info.rank, list(info.target_modules), info.policy_version) == (
        4,
        ["q_proj", "v_proj"],
        7,
    )
    assert (
        await asyncio.to_thread(complete, target, "file") == await asyncio.to_thread(reference, "b")
        or (await asyncio.to_thread(complete, target, "file"))[0] == reference("b")[0]
    )
    await asyncio.to_thread(unload, target, "file")
    assert spools(weights_dir) == []


async def test_an_adapter_streamed_from_a_peft_model_in_memory(
    server, tiny_llama, adapter_dirs, reference
) -> None:  # type: ignore[no-untyped-def]
    """What a trainer sends: peft's state dict and config, no files (docs/clients.md)."""
    from peft import get_peft_model_state_dict

    _, target = server
    model = await asyncio.to_thread(peft_model, tiny_llama, adapter_dirs["b"])
    config = model.peft_config["default"].to_dict()  # target_modules is a set
    with Client(target, admin_token=ADMIN_TOKEN) as client:
        info = await asyncio.to_thread(
            client.load_adapter_tensors, "memory", config, get_peft_model_state_dict(model)
        )
    assert info.rank == 4
    got = await asyncio.to_thread(complete, target, "memory")
    assert_same_as_peft(got, await asyncio.to_thread(reference, "b"))
    await asyncio.to_thread(unload, target, "memory")


def _chunk(name: str, dtype: str, shape: list[int], offset: int, data: bytes) -> Any:
    tensor = apb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=offset, data=data)
    return apb.LoadAdapterStreamRequest(tensor=tensor)


def _header(name: str = "bad", config: str = '{"r": 8}', path: str = "") -> Any:
    request = apb.LoadAdapterRequest(name=name, path=path)
    return apb.LoadAdapterStreamRequest(
        header=apb.LoadAdapterStreamHeader(request=request, adapter_config=config)
    )


def _bad_streams(dirs: dict[str, Path]) -> Iterator[tuple[str, list[Any], str]]:
    """(case, messages, the BadRequest field the refusal names)."""
    good = good_chunks(dirs["a"])
    tensors = good[1:]
    key = tensors[0].tensor.name
    yield "no header", tensors, "header"
    yield "two headers", [good[0], good[0], *tensors], "header"
    yield "a path", [_header(path=str(dirs["a"])), *tensors], "header.request.path"
    yield "no name", [_header(name=""), *tensors], "header.request.name"
    yield "no config", [_header(config=""), *tensors], "header.adapter_config"
    yield "config not JSON", [_header(config="{r: 8"), *tensors], "header.adapter_config"
    yield "config a list", [_header(config="[8]"), *tensors], "header.adapter_config"
    big = json.dumps({"r": 8, "pad": "x" * 65536})
    yield "config too big", [_header(config=big), *tensors], "header.adapter_config"
    yield "no tensors", [good[0]], "tensor"
    yield "bad dtype", [good[0], _chunk(key, "F64", [8, 64], 0, b"\0" * 8)], "tensor.dtype"
    yield "incomplete", [good[0], _chunk(key, "F32", [8, 64], 0, b"\0" * 8)], "tensor.data"
    huge = [2**20, 2**20, 2**4]  # 64 TiB declared: refused before a byte is written
    yield "too big", [good[0], _chunk(key, "F32", huge, 0, b"\0" * 8)], "tensor.shape"
    first = tensors[0].tensor
    wrong = _chunk(first.name, first.dtype, [1, len(first.data) // 4], 0, first.data)
    yield "wrong shape", [good[0], wrong, *tensors[1:]], "tensor"
    wide = good_chunks(dirs["wide"])
    yield "rank above the max", wide, "header.adapter_config"


async def test_bad_streams_are_refused_naming_the_field_and_change_nothing(
    server, adapter_dirs, weights_dir
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    before = await asyncio.to_thread(listed, target)
    for case, messages, field in _bad_streams(adapter_dirs):
        got = await asyncio.to_thread(refusal, lambda m=messages: send(target, m))
        assert got == (grpc.StatusCode.INVALID_ARGUMENT, [field]), case
        assert await asyncio.to_thread(listed, target) == before, case
        assert spools(weights_dir) == [], case


async def test_a_streamed_name_already_loaded_is_already_exists(
    server, adapter_dirs, weights_dir
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    await asyncio.to_thread(stream, target, "twice", adapter_dirs["b"])
    kept = spools(weights_dir)
    got = await asyncio.to_thread(refusal, lambda: stream(target, "twice", adapter_dirs["a"]))
    assert got == (grpc.StatusCode.ALREADY_EXISTS, [])
    assert spools(weights_dir) == kept  # the failed load's spool is gone, the first's stays
    await asyncio.to_thread(unload, target, "twice")


async def test_a_streamed_replace_serves_the_new_version_and_deletes_the_old_spool(
    server, adapter_dirs, reference, weights_dir
) -> None:  # type: ignore[no-untyped-def]
    _, target = server
    first = await asyncio.to_thread(stream, target, "rl", adapter_dirs["b"])
    second = await asyncio.to_thread(
        stream, target, "rl", adapter_dirs["a"], replace=True, inflight="abort"
    )
    assert (first.policy_version, second.policy_version) == (1, 2)
    assert spools(weights_dir) == [Path(second.path).name]
    got = await asyncio.to_thread(complete, target, "rl")
    assert_same_as_peft(got, await asyncio.to_thread(reference, "a"))
    await asyncio.to_thread(unload, target, "rl")


async def test_a_restarted_engine_loads_a_streamed_adapter_again_from_its_spool(
    server, adapter_dirs, reference
) -> None:  # type: ignore[no-untyped-def]
    running, target = server
    await asyncio.to_thread(stream, target, "kept", adapter_dirs["a"])
    restarts, engine = running.engine.restarts, running.engine.engine
    assert engine is not None
    os.kill(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while running.engine.restarts == restarts or running.engine.state.value != "serving":
        assert time.monotonic() < deadline, "the engine did not come back"
        await asyncio.sleep(0.1)
    assert "kept" in await asyncio.to_thread(listed, target)
    got = await asyncio.to_thread(complete, target, "kept")
    assert_same_as_peft(got, await asyncio.to_thread(reference, "a"))
    await asyncio.to_thread(unload, target, "kept")
