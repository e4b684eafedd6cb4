"""End to end: a trainer process (tests/support/weight_trainer.py, with sluice_client.weight_transfer)
pushes weights over a gloo process group to a live server, at one and two tensor-parallel
ranks; bad lists and versions are refused before any byte moves; a trainer that dies
mid-broadcast changes nothing; an engine restart cannot replay a broadcast, so generation is
refused until an update replaces every tensor.

Each server serves checkpoint A; B has the same shapes and other weights. References are HF
transformers on B (greedy ids). Admin calls of the test itself use the synchronous client in
a thread (grpc/grpc#36066).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice_client import AsyncClient, Client, build_header, build_request

from tests.support.service_harness import running_server
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ADMIN_TOKEN = "e2e-admin"
PROMPTS = [[0, 17, 42, 99, 123, 7], [0, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = 8
BUCKET = 16 * 1024  # several buckets; the embeddings are larger than one
REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "tests" / "support" / "weight_trainer.py"


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


@pytest.fixture(scope="module")
def hf_b(checkpoint_b: Path) -> list[list[int]]:
    model = load_hf_model(checkpoint_b)
    return [hf_greedy(model, p, MAX_TOKENS)[0] for p in PROMPTS]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tiny_llama: Path):
    server = running_server(tiny_llama, fake=False, admin_token=ADMIN_TOKEN)
    async with server as (s, t):
        yield s, t


async def trainer(target: str, *steps: dict[str, Any]) -> tuple[int, list[dict]]:
    """Run a trainer process to its end: its exit status and one result per step it ended.
    It learns the engine's ranks from the server (GetServerInfo)."""
    spec = {
        "target": target,
        "admin_token": ADMIN_TOKEN,
        "bucket_bytes": BUCKET,
        "timeout": 30.0,
        "steps": list(steps),
    }
    path = os.pathsep.join([str(REPO / "clients" / "python"), str(REPO), *sys.path])
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(TRAINER),
        json.dumps(spec),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
    )
    out, _ = await asyncio.wait_for(process.communicate(), 240)
    return process.returncode or 0, [json.loads(line) for line in out.decode().splitlines()]


def push(checkpoint: Path, **fields: Any) -> dict[str, Any]:
    return {"weights": str(checkpoint / "model.safetensors"), **fields}


async def served_greedy(target: str) -> list[list[int]]:
    async with AsyncClient(target) as client:
        requests = [
            build_request(p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            for p in PROMPTS
        ]
        return [(await client.complete(r)).token_ids for r in requests]


async def served_version(target: str) -> int:
    async with AsyncClient(target) as client:
        return (await client.info()).policy_version


async def restore(target: str, checkpoint: Path) -> int:
    with Client(target, admin_token=ADMIN_TOKEN) as admin:
        applied = await asyncio.to_thread(admin.update_weights, str(checkpoint))
    return applied.policy_version


async def test_a_pushed_checkpoint_serves_hf_greedy_ids_under_the_pushed_version(
    target, tiny_llama, checkpoint_b, hf_b
) -> None:
    _, t = target
    version = await restore(t, tiny_llama) + 5
    assert await served_greedy(t) != hf_b
    status, results = await trainer(t, push(checkpoint_b, policy_version=version))
    assert status == 0 and results[0]["ok"], results
    assert results[0]["policy_version"] == version and results[0]["events"][0] == "paused"
    assert await served_greedy(t) == hf_b
    assert await served_version(t) == version


async def test_bad_lists_and_versions_are_refused_before_a_byte_moves_and_the_group_stays(
    target, tiny_llama, checkpoint_b, hf_b
) -> None:
    _, t = target
    served = await restore(t, tiny_llama)
    before = await served_greedy(t)
    status, results = await trainer(
        t,
        push(checkpoint_b, reshape="model.norm.weight"),
        push(checkpoint_b, bf16="model.layers.0.mlp.up_proj.weight"),
        push(checkpoint_b, policy_version=served),
        push(checkpoint_b),  # the group is still usable
    )
    shape, dtype, version, good = results
    assert status == 0
    assert (shape["code"], shape["events"]) == ("INVALID_ARGUMENT", [])
    assert "model.norm.weight: shape (3, 3)" in shape["message"]
    assert (dtype["code"], dtype["events"]) == ("INVALID_ARGUMENT", [])
    assert "model.layers.0.mlp.up_proj.weight: dtype BF16" in dtype["message"]
    assert (version["code"], version["events"]) == ("FAILED_PRECONDITION", [])
    assert good["ok"] and good["policy_version"] == served + 1
    assert before != hf_b and await served_greedy(t) == hf_b


async def test_a_trainer_that_dies_mid_broadcast_changes_nothing_and_the_server_serves_on(
    target, tiny_llama, checkpoint_b, hf_b
) -> None:
    server, t = target
    served = await restore(t, tiny_llama)
    before = await served_greedy(t)
    status, results = await trainer(t, push(checkpoint_b, die_after_buckets=1))
    assert status == 3 and results == []
    for _ in range(1200):  # the engine notices the closed connection: the update fails
        if not server.engine.updating_weights:
            break
        await asyncio.sleep(0.05)
    assert not server.engine.updating_weights
    assert await served_version(t) == served and await served_greedy(t) == before
    with Client(t, admin_token=ADMIN_TOKEN) as admin:  # the engine left the group
        source = apb.DistributedSource(
            tensors=[apb.TensorSpec(name="model.norm.weight", dtype="F32", shape=[64])]
        )
        header = build_header(distributed=source)
        with pytest.raises(grpc.RpcError) as refused:
            await asyncio.to_thread(
                lambda: list(
                    admin.admin_stub.UpdateWeights(
                        iter([apb.UpdateWeightsRequest(header=header)]),
                        metadata=admin.admin_metadata,
                    )
                )
            )
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "InitWeightTransfer" in refused.value.details()
    status, results = await trainer(t, push(checkpoint_b))  # a new group works
    assert status == 0 and results[0]["ok"] and await served_greedy(t) == hf_b


async def test_after_a_restart_a_broadcast_is_not_replayed_and_generation_waits_for_every_tensor(
    target, tiny_llama, checkpoint_b, hf_b
) -> None:
    server, t = target
    await restore(t, tiny_llama)
    status, results = await trainer(t, push(checkpoint_b))
    assert status == 0 and results[0]["ok"]
    pushed = results[0]["policy_version"]
    restarts = server.engine.restarts
    engine = server.engine.engine
    assert engine is not None and engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    for _ in range(1200):
        if server.engine.restarts > restarts and server.engine.state.value == "awaiting_weights":
            break
        await asyncio.sleep(0.05)
    assert server.engine.state.value == "awaiting_weights"
    async with AsyncClient(t) as client:
        info = await client.info()
        assert info.policy_version == pushed  # never backwards
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete(build_request(PROMPTS[0], max_tokens=2))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "lost policy version" in (refused.value.details() or "")
    with Client(t, admin_token=ADMIN_TOKEN) as admin:  # a partial update is not enough
        norm = {"model.norm.weight": ("F32", [64], bytes(64 * 4))}
        with pytest.raises(grpc.RpcError) as partial:
            await asyncio.to_thread(admin.update_weights_inline, norm)
    assert partial.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "every tensor" in partial.value.details()
    assert await restore(t, checkpoint_b) == pushed + 1  # a whole checkpoint is
    assert server.engine.state.value == "serving"
    assert await served_greedy(t) == hf_b


async def test_two_ranks_each_receive_every_bucket_and_serve_hf_greedy_ids(
    tiny_llama, checkpoint_b, hf_b
) -> None:
    """The trainer is not told the server's tensor-parallel size: it asks."""
    engine = {"tensor_parallel_size": 2, "cpu_threads": 1}
    async with running_server(tiny_llama, fake=False, engine=engine, admin_token=ADMIN_TOKEN) as (
        _,
        t,
    ):
        async with AsyncClient(t) as client:
            assert (await client.info()).tensor_parallel_size == 2
        status, results = await trainer(t, push(checkpoint_b))
        assert status == 0 and results[0]["ok"], results
        assert await served_greedy(t) == hf_b
