"""`/v1/chat/completions`: an OpenAI chat request as a sluice.v1 GenerateRequest with a
ChatPrompt (rendered by the checkpoint's chat template in admission, as for gRPC callers),
and its events as OpenAI's chat answer, whole or streamed.

A message's `role` and string `content` become ChatMessage fields; everything else a message
carries (`name`, `tool_calls`, content as a list of text parts ...) travels in its extra_json,
as the template sees it. `response_format` json_schema / json_object become sluice.v1's
structured output.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sluice.v1 import generation_pb2 as pb

from service.openai.choices import Choice, Choices
from service.openai.fanout import Event, FanOut
from service.openai.logprobs import ChatLogprobs
from service.openai.schemas import ChatRequest
from service.openai.translate import FieldError, fill, request_id, set_max_tokens
from service.text.tokenizer import Tokenizer

# sluice.v1 field -> this request's field, where chat names it differently from completions.
CHAT_FIELDS = {"output.top_logprobs": "top_logprobs", "stop.max_tokens": "max_completion_tokens"}


def chat_prompt(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
) -> pb.ChatPrompt:
    prompt = pb.ChatPrompt(continue_final_message=continue_final_message)
    if add_generation_prompt is not None:
        prompt.add_generation_prompt = add_generation_prompt
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise FieldError(f"messages[{i}].role", "must be a string")
        extra = {k: v for k, v in message.items() if k not in ("role", "content")}
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise FieldError(f"messages[{i}].content", "only text parts are supported")
            extra["content"] = content
            content = ""
        elif content is not None and not isinstance(content, str):
            raise FieldError(f"messages[{i}].content", "must be a string or a list of parts")
        prompt.messages.add(
            role=role, content=content or "", extra_json=json.dumps(extra) if extra else ""
        )
    return prompt


def request(body: ChatRequest, adapter: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id("chatcmpl"))
    req.chat.CopyFrom(
        chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message)
    )
    if body.tools and body.tool_choice == "none":
        req.chat.tools_json = json.dumps(body.tools)
    if body.chat_template_kwargs:
        req.chat.template_kwargs_json = json.dumps(body.chat_template_kwargs)
    fill(req, body, adapter)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    set_max_tokens(req, body.completion_limit(), field)
    if body.logprobs:
        req.output.logprobs = True
        req.output.top_logprobs = body.top_logprobs or 0
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        req.structured.json_object = True
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None  # ChatRequest.unsupported checked it
        req.structured.json_schema = json.dumps(rf.json_schema.json_schema)
    return req


class ChatAnswer:
    def __init__(self, body: ChatRequest, fanout: FanOut, model: str, tokenizer: Tokenizer) -> None:
        self.request = body
        self.fanout = fanout
        self.model = model
        self.id = fanout.submitted[0].admission.request.request_id
        self.created = int(time.time())
        self.choices = Choices(1, body.n)
        self.logprobs = [
            ChatLogprobs(tokenizer, body.skip_special_tokens) if body.logprobs else None
            for _ in self.choices.choices
        ]

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        choice = self.choices.absorb(event)
        response = event.response
        if choice is None:  # started: each choice's role first, as OpenAI streams it
            return [
                self._chunk(
                    [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]
                )
                for i in range(self.request.n)
            ]
        entry: dict[str, Any] = {"index": choice.index, "delta": {}, "logprobs": None}
        if response.HasField("tokens"):
            entry["delta"] = {"content": response.tokens.text}
            logprobs = self.logprobs[choice.index]
            if logprobs is not None:
                logprobs.add_tokens(response.tokens)
                entry["logprobs"] = logprobs.take()
            if self.request.return_token_ids:
                entry["token_ids"] = list(response.tokens.token_ids)
        elif choice.failure is not None:
            return []
        return [self._chunk([entry | choice.chunk_ending()])]

    def _chunk(
        self, choices: list[dict[str, Any]], kind: str = "chat.completion.chunk"
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": self.choices.usage()}

    def body(self, events: list[Event]) -> dict[str, Any]:
        logprobs: list[list[dict[str, Any]]] = [[] for _ in self.choices.choices]
        for event in events:
            for chunk in self.chunks(event):
                for entry in chunk["choices"]:
                    if entry["logprobs"] is not None:
                        logprobs[entry["index"]] += entry["logprobs"]["content"]
        choices = [self._choice(choice, logprobs[choice.index]) for choice in self.choices.choices]
        body = {**self._chunk(choices, "chat.completion"), "usage": self.choices.usage()}
        if self.request.return_token_ids:
            body["prompt_token_ids"] = self.fanout.prompt_ids(0)
        return body

    def _choice(self, choice: Choice, content: list[dict[str, Any]]) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "index": choice.index,
            "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": {"content": content} if self.request.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            **choice.extensions(),
        }
        if self.request.return_token_ids:
            entry["token_ids"] = choice.token_ids
        return entry
