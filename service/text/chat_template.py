"""ChatTemplate: a checkpoint's Jinja chat template, rendered as transformers renders it.

What the template sees is what transformers' `apply_chat_template` gives it: the messages
without their None-valued keys (clients send `tool_calls: None`; templates test for a missing
key), `reasoning_content` aliased from older names, `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and the
caller's keyword arguments, in transformers' environment (service/text/chat_environment.py).
The rendered text is tokenized without special tokens (the template writes BOS itself), so the
ids equal transformers' `apply_chat_template(..., tokenize=True)` for the same checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from service.text.chat_environment import chat_environment

# The special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers marks the end of the final message with this tag to cut the render there.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# What transformers passes the template itself: keyword arguments cannot set them (transformers
# fails with a TypeError on a second value of an argument).
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


class RenderTooLong(ValueError):
    """The rendered text passed the size the caller allowed; rendering stopped there."""


@dataclass(frozen=True)
class Chat:
    """One conversation to render: plain JSON data, as a caller would give transformers."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] | None = None


class ChatTemplate:
    """A checkpoint's compiled chat template (or its named templates) and special tokens."""

    def __init__(self, source: str | Mapping[str, str], special_tokens: Mapping[str, str]) -> None:
        """`source`: one template, or named ones (tokenizer_config.json's list): "tool_use"
        renders a chat with tools when there is one, "default" the others, as transformers
        picks them."""
        env = chat_environment()
        named = {"default": source} if isinstance(source, str) else dict(source)
        self.sources = named
        self.special_tokens = dict(special_tokens)
        self._templates = {name: env.from_string(text) for name, text in named.items()}

    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, override: str | Path | None = None
    ) -> ChatTemplate | None:
        """The checkpoint's template: `override` (a file) if given, else chat_template.jinja,
        else tokenizer_config.json's `chat_template` (a string, or a list of named templates).
        None when the checkpoint has none."""
        directory = Path(checkpoint_dir)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        special = {
            name: _token_text(config[name])
            for name in SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        origin: Path = directory / "chat_template.jinja"
        if override is not None:
            origin = Path(override)
            source: Any = origin.read_text()
        elif origin.exists():
            source = origin.read_text()
        else:
            origin = config_path
            source = config.get("chat_template")
            if isinstance(source, list):
                source = {t["name"]: t["template"] for t in source if t.get("template")}
        if not source:
            return None
        try:
            return cls(source if isinstance(source, dict) else str(source), special)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template of {origin} does not parse: {exc}") from exc

    def render(self, chat: Chat, max_chars: int) -> str:
        """The prompt text of `chat`; raises ChatTemplateError where transformers'
        apply_chat_template raises, or RenderTooLong past `max_chars` characters (rendering
        stops there: a template cannot grow without end)."""
        name = "tool_use" if chat.tools is not None and "tool_use" in self.sources else "default"
        if name not in self._templates:
            raise ChatTemplateError(
                f"the model's chat templates are {sorted(self.sources)}, with no default"
            )
        kwargs = dict(chat.kwargs or {})
        if reserved := sorted(RESERVED_VARIABLES.intersection(kwargs)):
            raise ChatTemplateError(f"template arguments may not set {', '.join(reserved)}")
        messages = [_alias_reasoning(_without_none(m)) for m in chat.messages]
        final = ""
        if chat.continue_final_message:
            if chat.add_generation_prompt:
                raise ChatTemplateError(
                    "continue_final_message and add_generation_prompt cannot both be set"
                )
            if "content" not in self.sources[name]:
                raise ChatTemplateError("continue_final_message: the template reads no content")
            final = _open_final_message(messages[-1])
        context = {
            **self.special_tokens,
            **kwargs,
            "messages": messages,
            "tools": chat.tools,
            "documents": None,
            "add_generation_prompt": chat.add_generation_prompt,
        }
        pieces: list[str] = []
        size = 0
        try:
            for piece in self._templates[name].generate(context):
                size += len(piece)
                if size > max_chars:
                    raise RenderTooLong(f"the rendered prompt passes {max_chars} characters")
                pieces.append(piece)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc) or type(exc).__name__) from exc
        except RenderTooLong:
            raise
        except Exception as exc:  # a template is code: any failure of it is the request's
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
        text = "".join(pieces)
        if chat.continue_final_message:
            text = _cut_at_tag(text, final)
        return text


def _open_final_message(message: dict[str, Any]) -> str:
    """Mark the end of `message`'s text (its content, or the last text block of a list
    content) with CONTINUE_TAG, as transformers does; the text it had."""
    content = message.get("content")
    if content is None:
        raise ChatTemplateError("continue_final_message: the final message has no content")
    if isinstance(content, str):
        message["content"] = content + CONTINUE_TAG
        return content
    if isinstance(content, list):
        blocks = [dict(b) if isinstance(b, dict) else b for b in content]  # the caller's stay
        for block in reversed(blocks):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text = str(block["text"])
                block["text"] = text + CONTINUE_TAG
                message["content"] = blocks
                return text
    raise ChatTemplateError("continue_final_message: the final message has no text to continue")


def _cut_at_tag(text: str, final: str) -> str:
    """transformers' continue_final_message: end the text where the final message ends."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the rendered chat"
        )
    at = text.rindex(CONTINUE_TAG.strip())
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def _without_none(message: Mapping[str, Any]) -> dict[str, Any]:
    """transformers drops a message's None-valued keys: APIs send `content=None` or
    `tool_calls=None`, and templates test whether a key is there, not whether it is None."""
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """transformers fills `reasoning_content` (and gpt-oss's `thinking`) from older names."""
    names = ("reasoning_content", "thinking", "reasoning")
    reasoning = next((message[k] for k in names if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _token_text(value: Any) -> str:
    """A special token in tokenizer_config.json: its text, or an AddedToken's `content`."""
    return str(value["content"]) if isinstance(value, dict) else str(value)
