"""OpenAI's error JSON, {"error": {"message", "type", "param", "code"}}, with the HTTP status
that matches a Refusal's gRPC code: one table, here.

sluice.v1's field paths (`sampling.temperature`) are renamed to the OpenAI request's own
(`temperature`), so that an error names the field the caller sent.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from service.rpc.refusal import Refusal

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# The fields whose value may take several shapes: what a wrong one is told.
UNION_SHAPES = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of lists of "
    "token ids",
    "stop": "must be a string or a list of strings",
    "tool_choice": "must be a string or an object",
}
# sluice.v1 field path -> the OpenAI request's field; the longest matching prefix wins.
FIELD_NAMES = {
    "text": "prompt",
    "token_ids": "prompt",
    "chat.messages": "messages",
    "chat.tools_json": "tools",
    "chat.template_kwargs_json": "chat_template_kwargs",
    "chat": "messages",
    "stop.max_tokens": "max_tokens",
    "stop.stop": "stop",
    "stop.min_tokens": "min_tokens",
    "stop.stop_token_ids": "stop_token_ids",
    "output.top_logprobs": "logprobs",
    "structured.json_schema": "response_format.json_schema.schema",
    "structured": "response_format",
    "adapter": "model",
    "n": "n",
    "sampling": "",
}


def openai_field(path: str, overrides: dict[str, str] | None = None) -> str:
    """The OpenAI name of a sluice.v1 field path; `overrides` first (chat's `max_tokens` is
    `max_completion_tokens`, its `logprobs` `top_logprobs`)."""
    table = {**FIELD_NAMES, **(overrides or {})}
    for prefix in sorted(table, key=len, reverse=True):
        if path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "["):
            rest = path[len(prefix) :].lstrip(".")
            name = table[prefix]
            return f"{name}.{rest}" if name and rest and not rest.startswith("[") else name + rest
    return path


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    retry_after_ms: int | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }
    headers = {}
    if retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_ms / 1000)))
    return JSONResponse(body, status_code=status, headers=headers)


def refusal_response(refusal: Refusal, overrides: dict[str, str] | None = None) -> JSONResponse:
    """A Refusal as OpenAI's error: fields renamed, the retry delay as Retry-After (seconds)."""
    status = HTTP_STATUS.get(refusal.code, 500)
    if refusal.violations:
        renamed = [(openai_field(f, overrides), d) for f, d in refusal.violations]
        message = "invalid request: " + "; ".join(f"{f}: {d}" for f, d in renamed)
        param: str | None = renamed[0][0]
    else:
        message, param = refusal.message, None
    code = refusal.code.name.lower()
    return error_response(status, message, param, code, refusal.retry_delay_ms)


def invalid(field: str, description: str) -> JSONResponse:
    return error_response(400, f"{field}: {description}", field, "invalid_argument")


def validation_errors(errors: list[dict[str, Any]]) -> JSONResponse:
    """pydantic's errors (a wrong shape or type) as one 400 naming the first field. A union's
    errors (one per type it tried, located under the type's name) are one error of the field."""
    described: dict[str, str] = {}
    for error in errors:
        location = [p for p in error.get("loc", ()) if not _type_name(p)]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in location)
        field = field.lstrip(".") or "body"
        top = field.split(".")[0].split("[")[0]
        if top in UNION_SHAPES:
            field, description = top, UNION_SHAPES[top]
        else:
            description = str(error.get("msg", "invalid"))
        described.setdefault(field, description)
    message = "invalid request: " + "; ".join(f"{f}: {d}" for f, d in described.items())
    return error_response(400, message, next(iter(described)), "invalid_argument")


def _type_name(part: object) -> bool:
    """A location part that names a union's member type, not a field."""
    return isinstance(part, str) and (
        part == "body" or "[" in part or part in ("str", "int", "float", "bool")
    )
