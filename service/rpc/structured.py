"""Structured output at admission: GenerateRequest.structured as the engine's Constraint.

Its bounds (document size, choice count) are checked with the other fields, before anything
reads the documents; a JSON schema must then be a JSON object, nested at most MAX_DEPTH deep
(measured before it is parsed), that uses only what is enforced exactly (engine/protocol/validation/schema_rules.py: the
same check the engine makes before compiling). What only compiling tells
(a regex, grammar or schema the compiler refuses) is asked of the engine (CheckConstraint), which
compiles it off its step loop and keeps it cached for the request: a constraint that does not
compile is refused INVALID_ARGUMENT naming its field, before the request is sent.
"""

from __future__ import annotations

import grpc
from sluice.v1 import generation_pb2 as pb

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import Constraint
from engine.protocol.validation.schema_rules import SchemaRuleError, check_schema
from service.engine_link.engine_client import EngineClient
from service.engine_link.engine_process import EngineUnavailableError
from service.rpc.engine_status import engine_status
from service.rpc.refusal import Refusal, invalid_argument


def constraint(req: pb.GenerateRequest) -> Constraint | None:
    """The request's constraint; None when it has none (json_object false is none)."""
    s = req.structured
    kind = s.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not s.json_object):
        return None
    if kind == "choice":
        return Constraint("choice", choices=tuple(s.choice.choices))
    if kind == "json_object":
        return Constraint("json_object")
    return Constraint(kind, getattr(s, kind))


def schema_violations(req: pb.GenerateRequest) -> list[tuple[str, str]]:
    """What is wrong with a JSON schema within its bounds (SamplingParams.errors checks them):
    not JSON, not an object, too deep, or using what is not enforced exactly."""
    c = constraint(req)
    if c is None or c.kind != "json_schema" or c.errors():
        return []
    try:
        check_schema(c.text, write_strings=False)  # patterns: the engine's check parses them
    except SchemaRuleError as exc:
        return [(c.field, str(exc))]
    return []


async def check_constraint(engine: EngineClient, c: Constraint, caller: str) -> None:
    """Have the engine compile the constraint (for `caller`, the gRPC peer: compiles are shared
    out fairly between callers); raises Refusal if it does not."""
    try:
        checked = await engine.calls.check_constraint(c, caller)
    except EngineUnavailableError as exc:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
    if checked.error_code is None:
        return
    if checked.error_code is ErrorCode.INVALID_ARGUMENT:
        field, _, why = checked.message.partition(": ")
        raise invalid_argument([(field, why)])
    raise Refusal(engine_status(checked.error_code), checked.message)
