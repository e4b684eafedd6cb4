"""Chat prompts: a ChatPrompt checked, rendered with the model's chat template, and tokenized.

Everything here happens before any engine work. Refusals: FAILED_PRECONDITION for a model
without a template, INVALID_ARGUMENT (naming the field) for anything wrong with the chat,
including the template's own raise_exception and any other failure to render.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from sluice.v1 import generation_pb2 as pb

from engine.protocol.messages import ModelInfo
from engine.protocol.validation.schema_rules import MAX_DEPTH, nesting_depth
from service.rpc.refusal import Refusal, invalid_argument
from service.text.chat_template import (
    RESERVED_VARIABLES,
    Chat,
    ChatTemplate,
    ChatTemplateError,
    RenderTooLong,
)
from service.text.tokenizer import Tokenizer


def no_template() -> Refusal:
    return Refusal(
        grpc.StatusCode.FAILED_PRECONDITION,
        "the served model has no chat template (none in its tokenizer_config.json or "
        "chat_template.jinja, and no --chat-template): send `text` or `token_ids`",
    )


def chat_violations(
    prompt: pb.ChatPrompt,
    info: ModelInfo,
    tokenizer: Tokenizer,
    max_messages: int,
    field: str = "chat",
) -> list[tuple[str, str]]:
    """What can be judged without rendering: the number of messages and their size first (no
    work per message before both pass: a hostile prompt of millions of empty turns is refused
    in constant time), then empty parts and bad JSON."""
    count = len(prompt.messages)
    if count == 0:
        return [(f"{field}.messages", "must not be empty")]
    if count > max_messages:
        return [
            (
                f"{field}.messages",
                f"{count} messages: at most {max_messages} (the server's --max-chat-messages)",
            )
        ]
    limit = tokenizer.max_text_bytes(info.max_model_len)
    size = sum(len(m.content.encode()) + len(m.extra_json.encode()) for m in prompt.messages)
    size += len(prompt.tools_json.encode()) + len(prompt.template_kwargs_json.encode())
    if size > limit:
        return [
            (
                field,
                f"{size} bytes of messages, tools and arguments cannot fit in the context of "
                f"{info.max_model_len} tokens (at most {limit} bytes for this tokenizer)",
            )
        ]
    errors: list[tuple[str, str]] = []
    for i, message in enumerate(prompt.messages):
        if not message.role:
            errors.append((f"{field}.messages[{i}].role", "must not be empty"))
        if message.extra_json:
            errors += _extra_violations(message, f"{field}.messages[{i}].extra_json")
    if prompt.tools_json and not isinstance(_json(prompt.tools_json), list):
        errors.append((f"{field}.tools_json", f"must be a JSON array {_NESTED}"))
    kwargs = _json(prompt.template_kwargs_json) if prompt.template_kwargs_json else {}
    if not isinstance(kwargs, dict):
        errors.append((f"{field}.template_kwargs_json", f"must be a JSON object {_NESTED}"))
    elif reserved := sorted(RESERVED_VARIABLES.intersection(kwargs)):
        errors.append(
            (
                f"{field}.template_kwargs_json",
                f"must not set {', '.join(reserved)} (set by the chat)",
            )
        )
    if prompt.continue_final_message and prompt.add_generation_prompt:
        errors.append(
            (f"{field}.add_generation_prompt", "must be false with continue_final_message")
        )
    return errors


def _extra_violations(message: pb.ChatMessage, field: str) -> list[tuple[str, str]]:
    extra = _json(message.extra_json)
    if not isinstance(extra, dict):
        return [(field, f"must be a JSON object {_NESTED}")]
    if "role" in extra:
        return [(field, "must not hold `role` (the message's role field)")]
    if "content" in extra and message.content:
        return [(field, "must not hold `content` when the message's content field is set")]
    return []


def to_chat(prompt: pb.ChatPrompt) -> Chat:
    """The plain data a template sees; the prompt has passed chat_violations. As transformers,
    a message has no None-valued keys: extra_json's `"content": null` leaves it no content
    (and its `content`, e.g. a list of text blocks, takes the content field's place)."""
    messages = []
    for m in prompt.messages:
        message = {"role": m.role, "content": m.content}
        if m.extra_json:
            message.update(_json(m.extra_json))
        messages.append({k: v for k, v in message.items() if v is not None})
    # continue_final_message leaves the final message open, so no generation prompt by default.
    add_generation_prompt = (
        prompt.add_generation_prompt
        if prompt.HasField("add_generation_prompt")
        else not prompt.continue_final_message
    )
    return Chat(
        messages=messages,
        tools=_json(prompt.tools_json) if prompt.tools_json else None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=prompt.continue_final_message,
        kwargs=_json(prompt.template_kwargs_json) if prompt.template_kwargs_json else None,
    )


async def render(
    prompt: pb.ChatPrompt,
    template: ChatTemplate | None,
    info: ModelInfo,
    tokenizer: Tokenizer,
    max_messages: int,
    field: str = "chat",
    checked: bool = False,
) -> tuple[str, list[int]]:
    """The rendered text and its token ids, or a Refusal (also for ids that leave no room in
    the context). `checked`: the prompt has passed chat_violations already. The conversion
    and the rendering run in a worker thread: a template is a program, and a long
    conversation takes a while."""
    if template is None:
        raise no_template()
    violations = [] if checked else chat_violations(prompt, info, tokenizer, max_messages, field)
    if violations:
        raise invalid_argument(violations)
    limit = tokenizer.max_text_bytes(info.max_model_len)

    def convert_and_render() -> str:
        return template.render(to_chat(prompt), limit)

    try:
        text = await asyncio.to_thread(convert_and_render)
    except RenderTooLong as exc:
        raise invalid_argument([(field, f"{exc}: it cannot fit in the context")]) from exc
    except ChatTemplateError as exc:
        raise invalid_argument([(field, f"the chat template refused it: {exc}")]) from exc
    ids = await tokenizer.encode(text, add_special_tokens=False)
    if len(ids) >= info.max_model_len:
        raise invalid_argument(
            [
                (
                    "prompt",
                    f"the rendered chat's {len(ids)} tokens leave no room in the context of "
                    f"{info.max_model_len} tokens",
                )
            ]
        )
    return text, ids


_NESTED = f"(nested at most {MAX_DEPTH} deep)"


def _json(text: str) -> Any:
    """The parsed text, or None if it is not JSON or nests deeper than MAX_DEPTH: measured
    before parsing, as json.loads meets deep nesting with a RecursionError."""
    if nesting_depth(text) > MAX_DEPTH:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
