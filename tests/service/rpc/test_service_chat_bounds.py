"""A hostile ChatPrompt against a real `sluice serve`: millions of empty turns within the byte
bound are refused on their count before any is read, and health checks and other callers are
answered meanwhile (the event loop only parses the message, which the byte bound limits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import Client

from tests.support.server_process import ServerProcess, server_process

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
# Empty turns of role "u": 5 bytes each on the wire, so 1.5 million fit in 7.5 MB, well under
# the default --max-message-bytes (16 MiB).
HOSTILE_TURNS = 1_500_000


def hostile_render_chat(turns: int) -> bytes:
    """A serialized RenderChatRequest of `turns` messages {role: "u"}, built as bytes (building
    the protobuf objects would take the test longer than the server)."""
    message = b"\x0a\x03\x0a\x01u"  # ChatPrompt.messages (1) = ChatMessage{role (1): "u"}
    chat = message * turns
    return b"\x0a" + _varint(len(chat)) + chat  # RenderChatRequest.chat (1)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def peak_memory(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (Linux: VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("chat_bounds")
    (root / "template.jinja").write_text(TEMPLATE)
    flags = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32"]
    flags += ["--chat-template", str(root / "template.jinja")]
    with server_process(root / "server.log", *flags) as running:
        running.wait_health("SERVING")
        yield running


def probe_health(
    target: str, ready: threading.Event, done: threading.Event, latencies: list[float]
) -> None:
    """Health checks one after another, from `ready` (connected) until `done`, each one's
    latency recorded; at least one starts after `ready`."""
    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        check(health_pb2.HealthCheckRequest(), timeout=10)
        ready.set()
        while True:
            start = time.perf_counter()
            check(health_pb2.HealthCheckRequest(), timeout=30)
            latencies.append(time.perf_counter() - start)
            if done.is_set():
                return


@pytest.mark.timeout(120)
def test_millions_of_empty_turns_are_refused_on_their_count_while_health_answers(server):
    hostile = hostile_render_chat(HOSTILE_TURNS)
    # What the server cannot avoid: parsing the message, on its event loop.
    start = time.perf_counter()
    assert len(pb.RenderChatRequest.FromString(hostile).chat.messages) == HOSTILE_TURNS
    parse = time.perf_counter() - start

    peak_before = peak_memory(server.proc.pid)
    latencies: list[float] = []
    ready, done = threading.Event(), threading.Event()
    prober = threading.Thread(target=probe_health, args=(server.target, ready, done, latencies))
    prober.start()
    assert ready.wait(timeout=10)
    with grpc.insecure_channel(server.target) as channel:
        render_chat = channel.unary_unary(
            "/sluice.v1.Generation/RenderChat",
            request_serializer=None,  # the bytes as they are
            response_deserializer=pb.RenderChatResponse.FromString,
        )
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:
            render_chat(hostile, timeout=60)
        refused = time.perf_counter() - start
    done.set()
    prober.join()
    grown = peak_memory(server.proc.pid) - peak_before
    print(f"parse {parse:.2f} s, refused after {refused:.2f} s, health max {max(latencies):.2f} s")
    print(f"the service's peak memory grew by {grown / 2**20:.0f} MiB")

    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["chat.messages"]
    assert "at most 2048" in bad.field_violations[0].description
    # Refused in about the time of its parse (sending and receiving 7.5 MB come on top of it).
    assert refused < 3 * parse + 1.0
    assert max(latencies) < 3 * parse + 1.0
    # The parsed message (about 90 bytes a turn), not a Python dict per turn (about 500).
    assert grown < 200 * HOSTILE_TURNS
    with Client(server.target) as client:  # and an ordinary chat is served as ever
        rendered = client.render_chat([{"role": "user", "content": "hi"}], timeout=10)
    assert rendered.text == "user: hi\n"
