"""End to end: live weight updates through Admin.UpdateWeights on a real engine.

One server for the module, serving checkpoint A (tiny_llama); B has the same shapes and other
weights. Tests set the weights they start from (`serve`), so their order does not matter.
References come from in-process engines on A and B. Admin calls use the synchronous client in a
thread (the aio client can misreport an early refusal as INTERNAL, grpc/grpc#36066) beside the
event loop that runs the server and the streaming clients.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import admin_pb2_grpc
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, Client, Collector, build_header, build_request
from sluice_client.requests import Completion

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.service_harness import running_server
from tests.support.tiny_models import make_checkpoint

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ADMIN_TOKEN = "e2e-admin"
PROMPTS = [[0, 17, 42, 99, 123, 7], [0, 5, 6, 7, 8, 9, 10, 11], [0, 200, 3, 77], [0, 64, 65]]
MAX_TOKENS = 8
LONG = 64  # tokens of the requests an update lands in the middle of
CHECKED = 24  # tokens after a RECOMPUTE swap compared with the reference (it is slow on CPU)
INLINE = ("model.norm.weight", "model.layers.0.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


def make_engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def engine_a(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama)


@pytest.fixture(scope="module")
def engine_b(checkpoint_b: Path) -> LLMEngine:
    return make_engine(checkpoint_b)


def greedy_ids(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tiny_llama: Path):
    server = running_server(
        tiny_llama, fake=False, engine={"num_kv_pages": 512}, admin_token=ADMIN_TOKEN
    )
    async with server as (_, t):
        yield t


@pytest_asyncio.fixture(loop_scope="module")
async def client(target: str):
    async with AsyncClient(target) as c:
        yield c


@pytest.fixture(scope="module")
def admin(target: str):
    with Client(target, admin_token=ADMIN_TOKEN) as c:
        yield c


async def serve(admin: Client, checkpoint: Path, **options) -> apb.Applied:  # type: ignore[no-untyped-def]
    return await asyncio.to_thread(admin.update_weights, str(checkpoint), **options)


def greedy(prompt: list[int], max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return build_request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def served_greedy(client: AsyncClient) -> list[list[int]]:
    return [(await client.complete(greedy(p))).token_ids for p in PROMPTS]


def spans(completion: Completion) -> list[tuple[int, int, int]]:
    assert completion.finished is not None
    return [(s.policy_version, s.start, s.end) for s in completion.finished.version_spans]


class InFlight:
    """Long greedy requests streaming in the background; `started` once each has tokens."""

    def __init__(
        self, client: AsyncClient, prompts: list[list[int]], max_tokens: int = LONG
    ) -> None:
        self.collectors = [Collector() for _ in prompts]
        self._first = [asyncio.Event() for _ in prompts]
        self._tasks = [
            asyncio.ensure_future(self._run(client, greedy(p, max_tokens), i))
            for i, p in enumerate(prompts)
        ]

    async def _run(self, client: AsyncClient, request: pb.GenerateRequest, i: int) -> None:
        async for event in client.generate(request):
            self.collectors[i].add(event)
            if event.HasField("tokens"):
                self._first[i].set()

    async def started(self) -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._first)), 60)

    @property
    def running(self) -> bool:
        return not any(task.done() for task in self._tasks)

    async def results(self) -> list[Completion]:
        await asyncio.gather(*self._tasks)
        return [next(iter(c.completions.values())) for c in self.collectors]


# ---- swaps ----


async def test_after_an_update_from_b_greedy_outputs_are_b_under_the_new_version(
    client, admin, tiny_llama, checkpoint_b, engine_b
):
    before = (await serve(admin, tiny_llama)).policy_version
    applied = await serve(admin, checkpoint_b)
    assert (applied.previous_version, applied.policy_version) == (before, before + 1)
    info = await client.info()
    assert info.policy_version == before + 1 and info.state == pb.SERVING_STATE_SERVING
    expected = greedy_ids(engine_b, PROMPTS, MAX_TOKENS)
    for prompt, ids in zip(PROMPTS, expected, strict=True):
        completion = await client.complete(greedy(prompt))
        assert completion.token_ids == ids
        assert completion.started is not None
        assert completion.started.policy_version == before + 1
        assert set(completion.policy_versions) == {before + 1}
        assert spans(completion) == [(before + 1, 0, MAX_TOKENS)]


async def test_continue_switches_every_stream_once_between_two_chunks(
    client, admin, tiny_llama, checkpoint_b
):
    old = (await serve(admin, tiny_llama)).policy_version
    prompts = [[0, 10 + i, 20 + i, 30 + i] for i in range(16)]
    streams = InFlight(client, prompts)
    await streams.started()
    applied = await serve(admin, checkpoint_b, inflight="continue")
    assert applied.policy_version == old + 1 and applied.continued == 16
    for completion in await streams.results():
        (v0, s0, e0), (v1, s1, e1) = spans(completion)
        assert (v0, s0, v1, e1) == (old, 0, old + 1, LONG) and e0 == s1 and 0 < e0 < LONG
        # Chunks carry one version each; their tokens line up with the spans exactly.
        assert completion.policy_versions == [old] * e0 + [old + 1] * (LONG - e0)


async def test_recompute_continues_as_b_would_from_the_tokens_so_far(
    client, admin, tiny_llama, checkpoint_b, engine_b
):
    old = (await serve(admin, tiny_llama)).policy_version
    streams = InFlight(client, PROMPTS[:2])
    await streams.started()
    applied = await serve(admin, checkpoint_b, inflight="recompute")
    assert applied.recomputed == 2
    for prompt, completion in zip(PROMPTS[:2], await streams.results(), strict=True):
        (v0, _, swap), (v1, _, end) = spans(completion)
        assert (v0, v1, end) == (old, old + 1, LONG)
        before, after = completion.token_ids[:swap], completion.token_ids[swap:]
        assert after[:CHECKED] == greedy_ids(engine_b, [prompt + before], CHECKED)[0]


async def test_abort_ends_in_flight_requests_aborted_with_their_tokens_so_far(
    client, admin, tiny_llama, checkpoint_b, engine_a
):
    old = (await serve(admin, tiny_llama)).policy_version
    streams = InFlight(client, PROMPTS)
    await streams.started()
    applied = await serve(admin, checkpoint_b, inflight="abort")
    assert applied.aborted == len(PROMPTS)
    completions = await streams.results()
    longest = max(len(c.token_ids) for c in completions)
    full = greedy_ids(engine_a, PROMPTS, longest)
    for completion, expected in zip(completions, full, strict=True):
        n = len(completion.token_ids)
        assert completion.reason == "ABORTED" and 0 < n < LONG
        assert completion.finished is not None and completion.finished.usage.completion_tokens == n
        assert completion.token_ids == expected[:n] and set(completion.policy_versions) == {old}


async def test_drain_lets_in_flight_requests_finish_on_the_old_weights(
    client, admin, tiny_llama, checkpoint_b
):
    old = (await serve(admin, tiny_llama)).policy_version
    streams = InFlight(client, PROMPTS[:1])
    await streams.started()
    progress: list[apb.UpdateWeightsProgress] = []
    swap = asyncio.ensure_future(serve(admin, checkpoint_b, on_progress=progress.append))
    states = set()
    while not swap.done():
        states.add((await client.info()).state)
    applied = await swap
    assert pb.SERVING_STATE_UPDATING_WEIGHTS in states
    assert progress[0].paused.in_flight == 1 and applied.policy_version == old + 1
    (completion,) = await streams.results()
    assert completion.reason == "LENGTH" and set(completion.policy_versions) == {old}


async def test_a_drain_that_times_out_is_aborted_and_keeps_the_old_weights(
    client, admin, tiny_llama, checkpoint_b
):
    old = (await serve(admin, tiny_llama)).policy_version
    streams = InFlight(client, PROMPTS[:1])
    await streams.started()
    with pytest.raises(grpc.RpcError) as err:
        await serve(admin, checkpoint_b, drain_timeout_ms=1)
    assert err.value.code() == grpc.StatusCode.ABORTED  # type: ignore[attr-defined]
    (completion,) = await streams.results()
    assert completion.reason == "LENGTH" and set(completion.policy_versions) == {old}
    assert (await client.info()).policy_version == old


async def test_an_inline_update_of_two_chunked_tensors_changes_exactly_those(
    client, admin, tiny_llama, engine_a
):
    old = (await serve(admin, tiny_llama)).policy_version
    import torch

    generator = torch.Generator().manual_seed(5)
    params = engine_a.model.checkpoint_tensors()
    new = {name: torch.randn(params[name].shape, generator=generator) * 0.2 for name in INLINE}
    tensors = {name: ("F32", list(t.shape), t.numpy().tobytes()) for name, t in new.items()}
    applied = await asyncio.to_thread(admin.update_weights_inline, tensors, chunk_bytes=100)
    assert applied.policy_version == old + 1
    reference = make_engine(tiny_llama)
    with reference.live_weights() as live, torch.no_grad():
        for name, tensor in new.items():
            live[name].copy_(tensor)
    expected = greedy_ids(reference, PROMPTS, MAX_TOKENS)
    assert expected != greedy_ids(engine_a, PROMPTS, MAX_TOKENS)
    assert await served_greedy(client) == expected


# ---- refusals: status code, and nothing changes ----


def _raw_update(target: str, requests: list[apb.UpdateWeightsRequest], token: str | None):  # type: ignore[no-untyped-def]
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(target) as channel:
        try:
            for _ in admin_pb2_grpc.AdminStub(channel).UpdateWeights(
                iter(requests), metadata=metadata, timeout=60
            ):
                pass
        except grpc.RpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def inline(name: str, dtype: str, shape: list[int]) -> list[apb.UpdateWeightsRequest]:
    size = {"F32": 4, "F16": 2}[dtype]
    count = 1
    for dim in shape:
        count *= dim
    data = bytes(random.Random(0).randrange(256) for _ in range(count * size))
    half = len(data) // 2
    return [
        apb.UpdateWeightsRequest(header=build_header(inline_tensors=True)),
        apb.UpdateWeightsRequest(
            tensor=apb.TensorChunk(name=name, dtype=dtype, shape=shape, data=data[:half])
        ),
        apb.UpdateWeightsRequest(tensor=apb.TensorChunk(name=name, offset=half, data=data[half:])),
    ]


def checkpoint(path: str, version: int = 0) -> list[apb.UpdateWeightsRequest]:
    header = build_header(checkpoint_dir=path, policy_version=version)
    return [apb.UpdateWeightsRequest(header=header)]


@pytest.fixture(scope="module")
def damaged_checkpoint(tmp_path_factory: pytest.TempPathFactory, checkpoint_b: Path) -> Path:
    directory = tmp_path_factory.mktemp("damaged")
    for file in checkpoint_b.iterdir():
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            data = data[: len(data) // 2]  # truncated mid-tensor
        (directory / file.name).write_bytes(data)
    return directory


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("wrong shape", grpc.StatusCode.INVALID_ARGUMENT),
        ("unknown tensor", grpc.StatusCode.INVALID_ARGUMENT),
        ("wrong dtype", grpc.StatusCode.INVALID_ARGUMENT),
        ("same version", grpc.StatusCode.FAILED_PRECONDITION),
        ("older version", grpc.StatusCode.FAILED_PRECONDITION),
        ("missing token", grpc.StatusCode.UNAUTHENTICATED),
        ("wrong token", grpc.StatusCode.UNAUTHENTICATED),
        ("missing checkpoint", grpc.StatusCode.INVALID_ARGUMENT),
        ("damaged checkpoint", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_a_refused_update_changes_neither_weights_nor_version(
    client, admin, target, tiny_llama, checkpoint_b, damaged_checkpoint, case, code
):
    served = (await client.info()).policy_version
    before = await served_greedy(client)
    requests, token = {
        "wrong shape": (inline("model.norm.weight", "F32", [32]), ADMIN_TOKEN),
        "unknown tensor": (inline("model.layers.9.nope.weight", "F32", [64]), ADMIN_TOKEN),
        "wrong dtype": (inline("model.norm.weight", "F16", [64]), ADMIN_TOKEN),
        "same version": (checkpoint(str(checkpoint_b), served), ADMIN_TOKEN),
        "older version": (checkpoint(str(checkpoint_b), max(served - 1, 1)), ADMIN_TOKEN),
        "missing token": (checkpoint(str(checkpoint_b)), None),
        "wrong token": (checkpoint(str(checkpoint_b)), "nope"),
        "missing checkpoint": (checkpoint(str(tiny_llama / "no-such-dir")), ADMIN_TOKEN),
        "damaged checkpoint": (checkpoint(str(damaged_checkpoint)), ADMIN_TOKEN),
    }[case]
    got, details = await asyncio.to_thread(_raw_update, target, requests, token)
    assert got == code, details
    info = await client.info()
    assert info.policy_version == served and info.state == pb.SERVING_STATE_SERVING
    assert await served_greedy(client) == before


async def test_a_prefix_cached_under_old_weights_is_not_reused_after_an_update(
    client, admin, tiny_llama
):
    await serve(admin, tiny_llama)
    prompt = [0] + [(11 * i) % 290 + 2 for i in range(47)]  # three pages of 16
    assert (await client.complete(greedy(prompt))).started.cached_tokens == 0
    assert (await client.complete(greedy(prompt))).started.cached_tokens > 0
    await serve(admin, tiny_llama, inflight="continue")
    assert (await client.complete(greedy(prompt))).started.cached_tokens == 0
    assert (await client.complete(greedy(prompt))).started.cached_tokens > 0


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("missing checkpoint", "no-such-dir"),
        ("wrong dtype", "model.norm.weight"),
        ("unknown tensor", "model.layers.9.nope.weight"),
    ],
)
async def test_a_bad_drain_update_fails_at_once_and_new_requests_run_during_a_long_one(
    client, admin, target, tiny_llama, case, named
):
    await serve(admin, tiny_llama)
    requests = {
        "missing checkpoint": checkpoint(str(tiny_llama / "no-such-dir")),
        "wrong dtype": inline("model.norm.weight", "F16", [64]),
        "unknown tensor": inline("model.layers.9.nope.weight", "F32", [64]),
    }[case]
    long = InFlight(client, PROMPTS[:1], max_tokens=500)  # seconds on CPU: outlives the rest
    await long.started()
    code, details = await asyncio.to_thread(_raw_update, target, requests, ADMIN_TOKEN)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and named in details
    assert long.running  # the refusal did not wait for the long generation to drain
    short = await client.complete(greedy(PROMPTS[1], 2))
    assert short.reason == "LENGTH" and long.running
    (completion,) = await long.results()
    assert completion.reason == "LENGTH"
