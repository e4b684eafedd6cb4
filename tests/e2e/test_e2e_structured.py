"""End to end: structured output through a real server and engine. Outputs are checked in the
constraint's own language; bad constraints are INVALID_ARGUMENT naming the field, and the
engine serves on unharmed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import jsonschema
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, Collector, build_request

from engine.protocol.messages import MAX_CONSTRAINT_BYTES
from tests.support.service_harness import running_server

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

TEXT = "The answer, in one word:"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_llama: Path):
    async with (
        running_server(tiny_llama, fake=False, engine={"num_kv_pages": 128}) as (server, target),
        AsyncClient(target) as c,
    ):
        yield server, c


def constrained(**structured: object) -> pb.GenerateRequest:
    request = build_request(TEXT, max_tokens=200, temperature=1.0, seed=5)
    request.structured.CopyFrom(pb.StructuredOutput(**structured))  # type: ignore[arg-type]
    return request


async def test_a_json_schema_output_parses_and_validates(served) -> None:  # type: ignore[no-untyped-def]
    _, client = served
    request = constrained(json_schema=json.dumps(SCHEMA))
    request.n = 3
    completions = await client.complete(request)
    assert len(completions) == 3
    for c in completions:
        assert c.finished.reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(c.text), SCHEMA)


async def test_constrained_and_free_requests_share_a_stream(served) -> None:  # type: ignore[no-untyped-def]
    _, client = served
    choices = ["yes", "no", "maybe so"]
    requests = [
        constrained(choice=pb.ChoiceList(choices=choices)),
        constrained(regex=r"[0-9]{3}-[a-z]{2}"),
        build_request(TEXT, max_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    for i, r in enumerate(requests):
        r.request_id = f"s{i}"
    collector = Collector()
    async for event in client.generate_many(requests):
        collector.add(event)
    choice, regex, free = (collector.completions[(f"s{i}", 0)] for i in range(3))
    assert choice.text in choices
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text)
    assert len(free.token_ids) == 12


BAD = [
    (dict(regex="a(b"), "structured.regex", "parenthesis"),
    (dict(grammar='start ::= "a"'), "structured.grammar", "root"),
    (dict(json_schema='{"type": "nonsense"}'), "structured.json_schema", "nonsense"),
    (dict(json_schema='{"type": '), "structured.json_schema", "not valid JSON"),
    (dict(json_schema="[1, 2]"), "structured.json_schema", "a JSON object"),
    (dict(json_schema='{"allOf": [{}]}'), "structured.json_schema", "allOf at # is not"),
    (
        dict(json_schema='{"type": "string", "pattern": "(a)\\\\1"}'),
        "structured.json_schema",
        "pattern at # backreferences",
    ),
    (dict(choice=pb.ChoiceList()), "structured.choice.choices", "1 to 1024"),
    (dict(choice=pb.ChoiceList(choices=["a", ""])), "structured.choice.choices", "non-empty"),
    (dict(regex="a" * (MAX_CONSTRAINT_BYTES + 1)), "structured.regex", "at most"),
]


@pytest.mark.parametrize(("structured", "field", "words"), BAD, ids=[b[1] + b[2] for b in BAD])
async def test_a_bad_constraint_is_invalid_argument_naming_the_field(
    served, structured, field, words
) -> None:  # type: ignore[no-untyped-def]
    server, client = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.complete(constrained(**structured))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details() and "/project/" not in err.value.details()
    status = rpc_status.from_call(err.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == [field]
    # The engine serves on: nothing restarted, the next request runs.
    ok = await client.complete(build_request(TEXT, max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(ok.token_ids) == 3 and server.engine.restarts == 0


async def test_a_stop_string_cuts_a_constrained_text(served) -> None:  # type: ignore[no-untyped-def]
    _, client = served
    request = constrained(regex=r"[0-9]{3}-[a-z]{2}")
    request.stop.stop.append("-")
    c = await client.complete(request)
    assert c.finished.reason == pb.FINISH_REASON_STOP_STRING
    assert re.fullmatch(r"[0-9]{3}", c.text)
