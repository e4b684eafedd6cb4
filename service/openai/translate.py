"""The fields completions and chat share, written into a sluice.v1 GenerateRequest.

Only the mapping lives here: sluice.v1's admission judges every value (ranges, vocabulary,
context) as it does for a gRPC caller. A value the request message cannot even hold (a
negative count into an unsigned field, a logit_bias key that is no token id) is a FieldError.
"""

from __future__ import annotations

import uuid

from sluice.v1 import generation_pb2 as pb

from service.openai.schemas import Sampling

FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "min_p",
    "repetition_penalty",
)


class FieldError(ValueError):
    """A request field whose value cannot be expressed in sluice.v1: 400 naming it."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def fill(req: pb.GenerateRequest, body: Sampling, adapter: str) -> None:
    """Sampling, stops, n and output options common to both endpoints."""
    s = req.sampling
    for name in FLOAT_FIELDS:
        if (value := getattr(body, name)) is not None:
            setattr(s, name, value)
    if body.top_k is not None:
        s.top_k = 0 if body.top_k == -1 else body.top_k  # vLLM's -1: off
    if body.seed is not None:
        _set(s, "seed", body.seed, "seed", "must be >= 0")
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise FieldError("logit_bias", f"key {key[:32]!r} is not a token id")
        s.logit_bias[int(key)] = bias
    stop = req.stop
    stop.stop.extend(body.stops())
    _set(stop, "min_tokens", body.min_tokens, "min_tokens", "must be >= 0")
    if body.stop_token_ids:
        if min(body.stop_token_ids) < 0:
            raise FieldError("stop_token_ids", "token ids are >= 0")
        stop.stop_token_ids.extend(body.stop_token_ids)
    stop.ignore_eos = body.ignore_eos
    stop.include_stop_str_in_output = body.include_stop_str_in_output
    req.output.skip_special_tokens = body.skip_special_tokens
    _set(req, "n", body.n, "n", "must be >= 1")
    if adapter:
        req.adapter = adapter


def set_max_tokens(req: pb.GenerateRequest, value: int | None, field: str) -> None:
    if value is not None:
        _set(req.stop, "max_tokens", value, field, "must be >= 0")


def _set(message: object, name: str, value: int, field: str, description: str) -> None:
    try:
        setattr(message, name, value)
    except (ValueError, TypeError) as exc:
        raise FieldError(field, description) from exc
