"""End to end, through `python -m service`: a grammar bomb is refused past the compile time
limit naming its field while another connection's schema compiles at once, and a bomb whose
caller leaves is killed in the engine (AbandonCheck), not compiled on for nobody.

The bomb: grammar_bomb.py's GBNF grammar, 35 s or more of uninterruptible compile on this
tokenizer."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import Client, build_request

from tests.support.grammar_bomb import BOMB_RULES, wide_grammar
from tests.support.server_process import ServerProcess, server_process

pytestmark = pytest.mark.slow

TIME_LIMIT_S = 8.0
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
SMALL = pb.StructuredOutput(json_schema=json.dumps(SMALL_SCHEMA))


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("grammar") / "server.log"
    flags = ["--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32"]
    flags += ["--grammar-compile-timeout", str(TIME_LIMIT_S), "--grammar-compile-workers", "2"]
    with server_process(log, *flags) as server:
        server.wait_health("SERVING", timeout=300)
        # The workers start at the first compile: wait until both are up.
        assert generate(server.target, SMALL).ok
        server.wait_for("engine.grammar_worker_started", count=2, timeout=120)
        yield server


class Outcome:
    def __init__(self, error: grpc.RpcError | None, seconds: float) -> None:
        self.error, self.seconds = error, seconds
        self.ok = error is None


def generate(target: str, structured: pb.StructuredOutput, timeout: float | None = None) -> Outcome:
    """A one-token Generate under `structured`, on a connection of its own (the server shares
    compiles out by connection; channels to one target share one unless told not to)."""
    request = build_request([0, 5, 7], max_tokens=1)
    request.structured.CopyFrom(structured)
    options = [("grpc.use_local_subchannel_pool", 1)]
    start = time.monotonic()
    with grpc.insecure_channel(target, options=options) as channel:
        try:
            Client(target, channel=channel).complete(request, timeout=timeout)
        except grpc.RpcError as exc:
            return Outcome(exc, time.monotonic() - start)
    return Outcome(None, time.monotonic() - start)


def test_a_bomb_is_refused_past_the_limit_while_another_connections_schema_compiles(
    server: ServerProcess,
) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bomb = pool.submit(generate, server.target, pb.StructuredOutput(grammar=wide_grammar()))
        server.wait_for("engine.grammar_compile_slow", timeout=60)  # running for 1 s
        small = generate(server.target, SMALL)
        refused = bomb.result(timeout=120)
    assert small.ok and small.seconds < TIME_LIMIT_S / 2  # not behind the bomb
    assert refused.error is not None
    assert refused.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(refused.error)
    assert status is not None
    detail = error_details_pb2.BadRequest()
    status.details[0].Unpack(detail)
    (violation,) = detail.field_violations
    assert violation.field == "structured.grammar"
    assert violation.description == f"too costly to compile: not compiled within {TIME_LIMIT_S:g} s"
    assert TIME_LIMIT_S <= refused.seconds < 30  # the bomb alone takes 35 s
    assert server.health() == "SERVING"


def test_a_bomb_whose_caller_leaves_is_killed_not_compiled_on(server: ServerProcess) -> None:
    kills = len(server.events("engine.grammar_compile_killed"))
    left = generate(
        server.target, pb.StructuredOutput(grammar=wide_grammar(BOMB_RULES + 1)), timeout=1.0
    )
    assert left.error is not None and left.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    killed = server.wait_for("engine.grammar_compile_killed", count=kills + 1, timeout=60)
    assert killed["reason"] == "abandoned", killed
    assert generate(
        server.target,
        pb.StructuredOutput(json_schema=json.dumps({**SMALL_SCHEMA, "title": "after"})),
    ).ok
