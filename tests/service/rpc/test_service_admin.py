"""The Admin service (UpdateWeights) over a real grpc.aio server and a fake engine process.

Admin calls go through the synchronous client (the aio client may misreport an early refusal
of a client-streaming call, grpc/grpc#36066), run in a thread beside the server's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import resource
import struct
import threading
import time
from collections.abc import Iterable, Iterator

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import admin_pb2 as apb
from sluice.v1 import admin_pb2_grpc
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, Client, build_header, build_request, cli
from sluice_client.weights import DEFAULT_CHUNK_BYTES

from service import cli as serve_cli
from service.config import ServiceConfig
from tests.support.service_harness import make_fake_model, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_TOKEN = "adm1n-s3cret"
HOLD = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), hold_token=HOLD, update_delay=0.01)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model_dir, weights_dir):
    async with running_server(
        model_dir, admin_token=ADMIN_TOKEN, weights_dir=str(weights_dir)
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with AsyncClient(server[1]) as c:
        yield c


@pytest.fixture
def admin(server):
    with Client(server[1], admin_token=ADMIN_TOKEN) as c:
        yield c


class Outcome:
    """Every event an UpdateWeights call streamed, and how it ended."""

    def __init__(self) -> None:
        self.events: list[apb.UpdateWeightsProgress] = []
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.violations: list[str] = []

    @property
    def kinds(self) -> list[str]:
        return [str(e.WhichOneof("event")) for e in self.events]


def _call(target: str, requests: list[apb.UpdateWeightsRequest], token: str | None) -> Outcome:
    outcome = Outcome()
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(target) as channel:
        try:
            for event in admin_pb2_grpc.AdminStub(channel).UpdateWeights(
                iter(requests), metadata=metadata, timeout=30
            ):
                outcome.events.append(event)
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code(), err.details()
            status = rpc_status.from_call(err)
            for detail in status.details if status else []:
                bad = error_details_pb2.BadRequest()
                if detail.Unpack(bad):
                    outcome.violations += [v.field for v in bad.field_violations]
    return outcome


async def update(
    target: str, *requests: apb.UpdateWeightsRequest, token: str | None = ADMIN_TOKEN
) -> Outcome:
    return await asyncio.to_thread(_call, target, list(requests), token)


def header(**kwargs) -> apb.UpdateWeightsRequest:  # type: ignore[no-untyped-def]
    return apb.UpdateWeightsRequest(header=build_header(**kwargs))


def chunk(name: str, offset: int, data: bytes, dtype: str = "", shape: Iterable[int] = ()):  # type: ignore[no-untyped-def]
    tensor = apb.TensorChunk(name=name, dtype=dtype, shape=list(shape), offset=offset, data=data)
    return apb.UpdateWeightsRequest(tensor=tensor)


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


async def served_version(client: AsyncClient) -> int:
    return (await client.info()).policy_version


async def wait_for_state(client: AsyncClient, state: int) -> bool:
    for _ in range(200):
        if (await client.info()).state == state:
            return True
        await asyncio.sleep(0.01)
    return False


# ---- auth ----


async def test_admin_is_permission_denied_when_no_admin_token_is_configured(model_dir):
    async with running_server(model_dir) as (_, target):
        outcome = await update(target, header(checkpoint_dir="/b"), token="anything")
        assert outcome.code == grpc.StatusCode.PERMISSION_DENIED
        outcome = await update(target, header(checkpoint_dir="/b"), token=None)
        assert outcome.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("token", [None, "wrong", ADMIN_TOKEN + "x", ""])
async def test_a_missing_or_wrong_admin_token_is_unauthenticated(server, client, token):
    before = await served_version(client)
    outcome = await update(server[1], header(checkpoint_dir="/b"), token=token)
    assert outcome.code == grpc.StatusCode.UNAUTHENTICATED and outcome.events == []
    assert await served_version(client) == before


async def test_the_admin_token_never_reaches_the_logs(server, capfd):
    await update(server[1], header(checkpoint_dir="/b"), token="wrong-secret-zz")
    await update(server[1], header(checkpoint_dir="/b"))
    out, err = capfd.readouterr()
    assert ADMIN_TOKEN not in out + err and "wrong-secret-zz" not in out + err


# ---- the header ----


@pytest.mark.parametrize(
    ("requests", "field"),
    [
        ([], "header"),
        ([chunk("w", 0, b"\0" * 4, "F32", [1])], "header"),
        ([apb.UpdateWeightsRequest(header=apb.UpdateWeightsHeader(policy_version=9))], "header.source"),
        ([apb.UpdateWeightsRequest(header=apb.UpdateWeightsHeader(checkpoint_dir=""))], "header.checkpoint_dir"),
        ([apb.UpdateWeightsRequest(header=apb.UpdateWeightsHeader(inline_tensors=False))], "header.inline_tensors"),
        ([apb.UpdateWeightsRequest(header=apb.UpdateWeightsHeader(checkpoint_dir="/b", inflight=9))], "header.inflight"),  # type: ignore[arg-type]
    ],
)  # fmt: skip
async def test_a_missing_or_malformed_header_is_invalid_argument(server, requests, field):
    outcome = await update(server[1], *requests)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert outcome.violations == [field]


async def test_a_version_not_above_the_served_one_is_refused_before_any_chunk(server, client):
    served = await served_version(client)
    applied = await update(server[1], header(checkpoint_dir="/b", policy_version=served + 5))
    assert applied.events[-1].applied.policy_version == served + 5
    for version in (served + 5, served + 1):
        bad_chunk = chunk("w", 0, b"\0", "F64", [1])  # would be INVALID_ARGUMENT if read
        outcome = await update(
            server[1], header(inline_tensors=True, policy_version=version), bad_chunk
        )
        assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION, outcome.details
        assert outcome.events == []
    assert await served_version(client) == served + 5


# ---- progress ----


async def test_a_checkpoint_update_streams_paused_loading_applied(server, client):
    served = await served_version(client)
    outcome = await update(server[1], header(checkpoint_dir="/ckpt/b"))
    assert outcome.code == grpc.StatusCode.OK
    assert outcome.kinds == ["paused", "loading", "loading", "applied"]
    loading = outcome.events[2].loading
    assert loading.bytes_done == loading.bytes_total > 0
    assert loading.tensors_done == loading.tensors_total > 0
    applied = outcome.events[-1].applied
    assert (applied.previous_version, applied.policy_version) == (served, served + 1)
    info = await client.info()
    assert info.policy_version == served + 1 and info.state == pb.SERVING_STATE_SERVING


async def test_the_client_library_returns_applied_and_reports_progress(admin, client):
    served = await served_version(client)
    seen: list[str] = []
    applied = await asyncio.to_thread(
        admin.update_weights,
        "/ckpt/c",
        policy_version=served + 3,
        inflight="continue",
        on_progress=lambda e: seen.append(str(e.WhichOneof("event"))),
    )
    assert applied.policy_version == served + 3 and seen[0] == "paused" and seen[-1] == "applied"


async def test_tokens_after_an_update_carry_the_new_version_and_pass_the_gate(server, client):
    served = await served_version(client)
    gated = build_request([0, 5, 6], max_tokens=2, min_policy_version=served + 1)
    async with AsyncClient(server[1], retry=False) as once:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await once.complete(gated)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await update(server[1], header(checkpoint_dir="/ckpt/d"))
    completion = await client.complete(gated)
    assert completion.reason == "LENGTH"
    assert completion.started is not None and completion.started.policy_version == served + 1
    assert completion.policy_versions == [served + 1, served + 1]


async def test_abort_ends_in_flight_requests_aborted_and_counts_them(server, client):
    held = asyncio.ensure_future(client.complete([0, HOLD], max_tokens=5))
    await asyncio.sleep(0.2)
    outcome = await update(server[1], header(checkpoint_dir="/ckpt/e", inflight="abort"))
    assert outcome.events[0].paused.in_flight == 1
    assert outcome.events[-1].applied.aborted == 1
    assert (await held).reason == "ABORTED"


# ---- failures ----


@pytest.mark.parametrize(
    ("source", "code", "kinds"),
    [
        ("fail-INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT, []),
        ("fail-FAILED_PRECONDITION", grpc.StatusCode.FAILED_PRECONDITION, []),
        ("pause-fail-ABORTED", grpc.StatusCode.ABORTED, ["paused"]),
        ("fail-NOT_A_CODE", grpc.StatusCode.INTERNAL, []),
    ],
)
async def test_an_engine_failure_becomes_the_status_after_the_events_sent(
    server, client, source, code, kinds
):
    served = await served_version(client)
    outcome = await update(server[1], header(checkpoint_dir=f"/ckpt/{source}"))
    assert outcome.code == code and outcome.kinds == kinds
    assert source in outcome.details
    assert await served_version(client) == served
    assert (await update(server[1], header(checkpoint_dir="/ckpt/ok"))).code == grpc.StatusCode.OK


async def test_a_second_update_while_one_is_in_flight_is_refused(server, client):
    served = await served_version(client)
    first = asyncio.ensure_future(update(server[1], header(checkpoint_dir="/ckpt/slow")))
    assert await wait_for_state(client, pb.SERVING_STATE_UPDATING_WEIGHTS)
    second = await update(server[1], header(checkpoint_dir="/ckpt/b2"))
    assert second.code == grpc.StatusCode.FAILED_PRECONDITION and "in progress" in second.details
    assert (await first).code == grpc.StatusCode.OK
    info = await client.info()
    assert info.state == pb.SERVING_STATE_SERVING and info.policy_version == served + 1


def _start_and_walk_away(target: str) -> str:
    """Start a slow update, read its first event, then cancel the call."""
    with grpc.insecure_channel(target) as channel:
        call = admin_pb2_grpc.AdminStub(channel).UpdateWeights(
            iter([header(checkpoint_dir="/ckpt/slow")]),
            metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),),
        )
        first = next(call)
        call.cancel()
        return str(first.WhichOneof("event"))


async def test_an_update_whose_caller_left_still_holds_the_slot_until_it_ends(server, client):
    served = await served_version(client)
    assert await asyncio.to_thread(_start_and_walk_away, server[1]) == "paused"
    refused = await update(server[1], header(checkpoint_dir="/ckpt/b3"))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    for _ in range(200):
        if (await client.info()).state == pb.SERVING_STATE_SERVING:
            break
        await asyncio.sleep(0.02)
    assert await served_version(client) == served + 1  # the abandoned update went through
    assert (await update(server[1], header(checkpoint_dir="/ckpt/b4"))).code == grpc.StatusCode.OK


async def test_an_engine_death_mid_update_ends_it_unavailable(model_dir):
    async with running_server(model_dir, admin_token=ADMIN_TOKEN, restart_backoff=0.1) as (
        server,
        target,
    ):
        applied = await update(target, header(policy_version=7, checkpoint_dir="/ckpt/a"))
        assert applied.code == grpc.StatusCode.OK
        outcome = await update(target, header(checkpoint_dir="/ckpt/die"))
        assert outcome.code == grpc.StatusCode.UNAVAILABLE and outcome.kinds == ["paused"]
        for _ in range(200):
            if server.engine.restarts == 1 and server.engine.state.value == "serving":
                break
            await asyncio.sleep(0.05)
        # The restarted engine replayed the applied update: the version did not go back.
        async with AsyncClient(target) as client:
            assert await served_version(client) == 7
        assert (await update(target, header(checkpoint_dir="/ckpt/b"))).code == grpc.StatusCode.OK


def _stalling_call(target: str, requests: list[apb.UpdateWeightsRequest]) -> tuple[Outcome, float]:
    """Send `requests`, then neither another message nor the end of the stream until the
    call ends; how it ended, and after how many seconds."""
    release = threading.Event()

    def stalling() -> Iterator[apb.UpdateWeightsRequest]:
        yield from requests
        release.wait(timeout=30)

    outcome, started = Outcome(), time.monotonic()
    with grpc.insecure_channel(target) as channel:
        try:
            for event in admin_pb2_grpc.AdminStub(channel).UpdateWeights(
                stalling(), metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),), timeout=30
            ):
                outcome.events.append(event)
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code(), err.details()
        finally:
            release.set()
    return outcome, time.monotonic() - started


@pytest.mark.parametrize(
    "sent",
    [[], [header(inline_tensors=True), chunk("w", 0, floats(1.0), "F32", [2])]],
    ids=["nothing", "header and one chunk"],
)
async def test_a_stalled_update_is_aborted_after_the_idle_timeout_and_frees_the_slot(
    model_dir, tmp_path, sent
):
    async with running_server(
        model_dir, admin_token=ADMIN_TOKEN, weights_dir=str(tmp_path), update_idle_timeout=0.5
    ) as (_, target):
        outcome, seconds = await asyncio.to_thread(_stalling_call, target, sent)
        assert outcome.code == grpc.StatusCode.ABORTED and "idle-timeout" in outcome.details
        assert 0.4 < seconds < 5.0
        assert list(tmp_path.iterdir()) == []  # the half-sent tensor file is gone
        assert (
            await update(target, header(checkpoint_dir="/ckpt/next"))
        ).code == grpc.StatusCode.OK


# ---- inline tensors ----


async def test_inline_chunks_are_assembled_into_one_file_kept_until_a_checkpoint_supersedes_it(
    server, client, model_dir, weights_dir
):
    a, b = floats(*range(12)), floats(*range(100, 104))
    served = await served_version(client)
    outcome = await update(
        server[1],
        header(inline_tensors=True),
        chunk("layers.0.a", 0, a[:16], "F32", [3, 4]),
        chunk("norm.b", 8, b[8:], "F32", [4]),
        chunk("layers.0.a", 32, a[32:]),
        chunk("norm.b", 0, b[:8], "F32", [4]),
        chunk("layers.0.a", 16, a[16:32], "F32", [3, 4]),
    )
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert outcome.events[-1].applied.policy_version == served + 1
    described = json.loads((model_dir / "last_update.json").read_text())
    assert described["layers.0.a"]["sha256"] == hashlib.sha256(a).hexdigest()
    assert described["layers.0.a"]["shape"] == [3, 4]
    assert described["norm.b"]["sha256"] == hashlib.sha256(b).hexdigest()
    assert len(list(weights_dir.iterdir())) == 1  # kept: a restarted engine replays it
    assert (await update(server[1], header(checkpoint_dir="/ckpt/full"))).code == grpc.StatusCode.OK
    assert list(weights_dir.iterdir()) == []  # a whole checkpoint supersedes it


async def test_the_client_library_splits_inline_tensors_into_chunks(admin, model_dir):
    data = floats(*range(64))
    applied = await asyncio.to_thread(
        admin.update_weights_inline, {"big": ("F32", [8, 8], data)}, chunk_bytes=100
    )
    assert applied.policy_version > 0
    described = json.loads((model_dir / "last_update.json").read_text())
    assert described["big"]["sha256"] == hashlib.sha256(data).hexdigest()


async def test_the_clients_default_chunks_fit_under_the_default_receive_limit(admin, model_dir):
    data = bytes(range(256)) * (DEFAULT_CHUNK_BYTES // 256 + 1)  # one full chunk and a bit
    applied = await asyncio.to_thread(
        admin.update_weights_inline, {"big": ("F32", [len(data) // 4], data)}
    )
    assert applied.policy_version > 0
    described = json.loads((model_dir / "last_update.json").read_text())
    assert described["big"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert ServiceConfig.max_message_bytes >= DEFAULT_CHUNK_BYTES * 2  # room to spare


async def test_sluice_serve_takes_the_receive_limit_as_a_size():
    config = serve_cli.service_config(serve_cli.build_parser().parse_args([]))
    assert config.max_message_bytes == 16 * 2**20
    args = serve_cli.build_parser().parse_args(["--max-message-bytes", "8MiB"])
    assert serve_cli.service_config(args).max_message_bytes == 8 * 2**20


@pytest.mark.parametrize(
    ("chunks", "field"),
    [
        ([chunk("w", 0, b"\0" * 4, "F64", [1])], "tensor.dtype"),
        ([chunk("w", 0, b"\0" * 8, "F32", [2]), chunk("w", 4, b"\0" * 4)], "tensor.offset"),
        ([chunk("w", 0, b"\0" * 4, "F32", [2])], "tensor.data"),
        ([chunk("w", 4, b"\0" * 8, "F32", [2])], "tensor.offset"),
        ([chunk("w", 0, b"\0" * 4, "F32", [2]), chunk("w", 4, b"\0" * 4, "F16")], "tensor.dtype"),
        ([], "tensor"),
        ([chunk("w", 0, b"\0" * 4, "F32", [1]), header(inline_tensors=True)], "header"),
        ([chunk("w", 2**63, b"\0" * 4, "F32", [2**62])], "tensor.shape"),  # 2**64 bytes
        ([chunk("w", 0, b"\0" * 4, "F32", [1] * 9)], "tensor.shape"),
    ],
)
async def test_bad_chunks_are_invalid_argument_and_leave_nothing_behind(
    server, client, weights_dir, chunks, field
):
    served, files = await served_version(client), set(weights_dir.iterdir())
    outcome = await update(server[1], header(inline_tensors=True), *chunks)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and outcome.violations == [field]
    assert await served_version(client) == served
    assert set(weights_dir.iterdir()) == files  # the refused update's file is gone
    assert (await update(server[1], header(checkpoint_dir="/ckpt/ok"))).code == grpc.StatusCode.OK


async def test_a_tensor_past_the_file_size_limit_is_resource_exhausted_and_leaves_nothing(
    server, client, weights_dir
):
    """A tensor declared at the 16 TiB limit: its last bytes land past what a file may hold
    (ext4's limit; RLIMIT_FSIZE makes any file system refuse the same way)."""
    files = set(weights_dir.iterdir())
    last = chunk("w", 2**44 - 4, b"\0" * 4, "F32", [2**42])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**40, hard))
    try:
        outcome = await update(server[1], header(inline_tensors=True), last)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.details
    assert "'w'" in outcome.details and "--weights-dir" in outcome.details
    assert set(weights_dir.iterdir()) == files
    assert (await update(server[1], header(checkpoint_dir="/ckpt/ok"))).code == grpc.StatusCode.OK


# ---- the command line ----


async def test_cli_update_weights_prints_applied_as_json(server, client, tmp_path, capsys):
    served = await served_version(client)
    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    argv = ["update-weights", "--target", server[1], "--checkpoint", "/ckpt/cli"]
    argv += ["--inflight", "recompute", "--version", str(served + 2)]
    assert await asyncio.to_thread(cli.main, [*argv, "--admin-token-file", str(token_file)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["policyVersion"] == str(served + 2)
    assert "loading [" in err and "paused" in err
    assert await asyncio.to_thread(cli.main, argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


async def test_cli_sends_a_safetensors_file_inline(server, tmp_path, model_dir, capsys):
    import numpy as np
    from safetensors.numpy import save_file

    weights = {"x.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
    save_file(weights, str(tmp_path / "w.safetensors"))
    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    argv = ["update-weights", "--target", server[1], "--tensors", str(tmp_path / "w.safetensors")]
    argv += ["--admin-token-file", str(token_file), "--chunk-bytes", "8"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    described = json.loads((model_dir / "last_update.json").read_text())
    assert described["x.weight"]["shape"] == [2, 3]
    expected = hashlib.sha256(weights["x.weight"].tobytes()).hexdigest()
    assert described["x.weight"]["sha256"] == expected
