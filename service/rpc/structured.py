"""Structured output at admission: GenerateRequest.structured as the engine's Constraint.

Its bounds (document size, choice count) are checked with the other fields, before anything
reads the documents; a JSON schema must then parse as a JSON object. What only compiling tells
(a regex, grammar or schema the compiler refuses) is asked of the engine (CheckConstraint), which
compiles it off its step loop and keeps it cached for the request: a constraint that does not
compile is refused INVALID_ARGUMENT naming its field, before the request is sent.
"""

from __future__ import annotations

import json

import grpc
from sluice.v1 import generation_pb2 as pb

from engine.messages import Constraint
from service.engine_link.engine_client import EngineClient, EngineUnavailableError
from service.rpc.refusal import Refusal, engine_status, invalid_argument


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
    """A JSON schema within its bounds (SamplingParams.errors checks them) that is not a JSON
    object."""
    c = constraint(req)
    if c is None or c.kind != "json_schema" or c.errors():
        return []
    try:
        schema = json.loads(c.text)
    except ValueError as exc:
        return [(c.field, f"is not valid JSON: {exc}")]
    if not isinstance(schema, dict):
        return [(c.field, "must be a JSON object")]
    return []


async def check_constraint(engine: EngineClient, c: Constraint, caller: str) -> None:
    """Have the engine compile the constraint (for `caller`, the gRPC peer: compiles are shared
    out fairly between callers); raises Refusal if it does not."""
    try:
        checked = await engine.check_constraint(c, caller)
    except EngineUnavailableError as exc:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
    if checked.error_code is None:
        return
    if checked.error_code == "INVALID_ARGUMENT":
        field, _, why = checked.message.partition(": ")
        raise invalid_argument([(field, why)])
    raise Refusal(engine_status(checked.error_code), checked.message)
