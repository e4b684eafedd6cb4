"""The FastAPI application: OpenAI's routes over GenerationServicer's admission path.

Each route parses its body (schemas), names the model (the served one, or a loaded LoRA
adapter as vLLM serves them), translates to sluice.v1, submits through
`GenerationServicer.submit` and answers from its `events` (respond). Every failure is OpenAI's
error JSON: a Refusal with the HTTP status of its gRPC code (errors), a shape or field error
400 naming the field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from engine.protocol.validation.schema_rules import MAX_DEPTH, nesting_depth
from service.engine_link.engine_state import EngineState
from service.openai import chat, completions
from service.openai.errors import error_response, invalid, refusal_response, validation_errors
from service.openai.fanout import FanOut
from service.openai.gate import Gate
from service.openai.respond import respond
from service.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from service.openai.tokenize import detokenize, tokenize
from service.openai.translate import FieldError
from service.rpc.refusal import Refusal
from service.rpc.servicer import GenerationServicer

M = TypeVar("M", bound=BaseModel)


class Front:
    """What the routes do, over the servicer (and through it the engine and the config)."""

    def __init__(self, servicer: GenerationServicer) -> None:
        self.servicer = servicer

    @property
    def model(self) -> str:
        info = self.servicer.engine.info
        name = self.servicer.config.served_model_name
        return name or (info.model if info is not None else self.servicer.config.engine.model)

    def serving(self) -> bool:
        s = self.servicer
        return not s.draining and s.engine.state is EngineState.SERVING and s.tokenizer is not None

    def adapter(self, model: str | None) -> str | None:
        """The adapter a request's `model` names ("" for the base model), None if unknown."""
        if model is None or model == self.model:
            return ""
        return model if model in self.servicer.engine.adapters.versions else None

    def models(self) -> dict[str, Any]:
        """/v1/models: the served model, then the LoRA adapters loaded (as vLLM lists them)."""
        info, created = self.servicer.engine.info, int(time.time())
        data = []
        for name in [self.model, *sorted(self.servicer.engine.adapters.versions)]:
            entry: dict[str, Any] = {"id": name, "object": "model", "created": created}
            entry.update(owned_by="sluice", root=self.model)
            if name != self.model:
                entry["parent"] = self.model
            if info is not None:
                entry["max_model_len"] = info.max_model_len
            data.append(entry)
        return {"object": "list", "data": data}

    async def complete(self, body: CompletionRequest, adapter: str, call: Call) -> Response:
        if errors := body.unsupported():
            return invalid(*errors[0])
        requests = completions.requests(body, adapter)
        fanout = await FanOut.submit(self.servicer, requests, call.caller)
        assert self.servicer.tokenizer is not None  # submit checked it
        answer = completions.CompletionAnswer(body, fanout, self.model, self.servicer.tokenizer)
        return await respond(answer, call.disconnected)

    async def chat(self, body: ChatRequest, adapter: str, call: Call) -> Response:
        if errors := body.unsupported():
            return invalid(*errors[0])
        if self.servicer.tokenizer is not None and self.servicer.chat_template is None:
            return error_response(
                400,
                "the served model has no chat template (none in the checkpoint, and no "
                "--chat-template): use /v1/completions",
                "messages",
                "no_chat_template",
            )
        fanout = await FanOut.submit(self.servicer, [chat.request(body, adapter)], call.caller)
        assert self.servicer.tokenizer is not None  # submit checked it
        answer = chat.ChatAnswer(body, fanout, self.model, self.servicer.tokenizer)
        return await respond(answer, call.disconnected)

    async def tokenize(self, body: TokenizeRequest, adapter: str, call: Call) -> Response:
        self._check_serving()
        return JSONResponse(await tokenize(self.servicer, body))

    async def detokenize(self, body: DetokenizeRequest, adapter: str, call: Call) -> Response:
        self._check_serving()
        return JSONResponse(detokenize(self.servicer, body))

    def _check_serving(self) -> None:
        """submit's own refusal (UNAVAILABLE) for routes that do not submit."""
        if not self.serving():
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "the model is not serving")


def create_app(servicer: GenerationServicer) -> Gate:
    front = Front(servicer)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    async def health() -> Response:
        if front.serving():
            return Response(status_code=200)
        return error_response(503, "not serving", code="unavailable")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(front.models())

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await _handle(front, request, CompletionRequest, front.complete)

    @app.post("/v1/chat/completions")
    async def create_chat(request: Request) -> Response:
        return await _handle(front, request, ChatRequest, front.chat, chat.CHAT_FIELDS)

    @app.post("/tokenize")
    async def create_tokens(request: Request) -> Response:
        return await _handle(front, request, TokenizeRequest, front.tokenize)

    @app.post("/detokenize")
    async def create_text(request: Request) -> Response:
        return await _handle(front, request, DetokenizeRequest, front.detokenize)

    return Gate(app, servicer.config.api_token, servicer.config.max_message_bytes)


async def _handle(
    front: Front,
    request: Request,
    schema: type[M],
    run: Callable[[M, str, Call], Awaitable[Response]],
    fields: dict[str, str] | None = None,
) -> Response:
    """Parse the body into `schema`, resolve its model, and run; every failure as OpenAI's
    error (`fields`: this endpoint's names for sluice.v1 fields)."""
    raw = await request.body()
    if nesting_depth(raw.decode(errors="replace")) > MAX_DEPTH * 2:
        return invalid("body", f"JSON nested deeper than {MAX_DEPTH * 2}")
    try:
        parsed: Any = json.loads(raw)
    except ValueError as exc:
        return error_response(400, f"the body is not JSON: {exc}", None, "invalid_json")
    if not isinstance(parsed, dict):
        return invalid("body", "must be a JSON object")
    try:
        body = schema.model_validate(parsed)
    except ValidationError as exc:
        return validation_errors([dict(e) for e in exc.errors()])
    adapter = front.adapter(getattr(body, "model", None))
    if adapter is None:
        model = getattr(body, "model", "")
        return error_response(
            404, f"the model `{model}` does not exist", "model", "model_not_found"
        )
    try:
        return await run(body, adapter, Call(request))
    except Refusal as refusal:
        return refusal_response(refusal, fields)
    except FieldError as exc:
        return invalid(exc.field, exc.description)


class Call:
    """The HTTP call behind a request: who sent it, and whether they are still there."""

    def __init__(self, request: Request) -> None:
        self._request = request

    @property
    def caller(self) -> str:
        """The peer, in gRPC's form: structured-output compiles are shared out per caller."""
        client = self._request.client
        return "http:unknown" if client is None else f"http:{client.host}:{client.port}"

    async def disconnected(self) -> None:
        """Returns once the client has gone. The body has been read (by Gate), so the next
        ASGI message is the disconnect; uvicorn sends it when the connection closes."""
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
