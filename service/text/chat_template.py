"""ChatTemplate: a checkpoint's Jinja chat template, rendered as transformers renders it.

The environment mirrors transformers' `apply_chat_template` (utils/chat_template_utils.py):
an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loop controls
extension, a `tojson` filter that does not escape HTML (json.dumps, ensure_ascii False), and
the globals `raise_exception`, `strftime_now`, `dict` and `namespace`; the template sees
`messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) and the caller's keyword arguments. The rendered text is
tokenized without special tokens (the template writes BOS itself), so the ids equal
transformers' `apply_chat_template(..., tokenize=True)` for the same checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    """A compiled chat template and the special tokens its checkpoint defines."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = _environment().from_string(source)

    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, override: str | Path | None = None
    ) -> ChatTemplate | None:
        """The checkpoint's template: `override` (a file) if given, else chat_template.jinja,
        else tokenizer_config.json's `chat_template` (a string, or a list of named templates:
        the one named "default"). None when the checkpoint has none."""
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
                named = {t.get("name"): t.get("template") for t in source}
                source = named.get("default")
        if not source:
            return None
        try:
            return cls(str(source), special)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template of {origin} does not parse: {exc}") from exc

    def render(self, chat: Chat, max_chars: int) -> str:
        """The prompt text of `chat`; raises ChatTemplateError, or RenderTooLong past
        `max_chars` characters (rendering stops there: a template cannot grow without end)."""
        messages = [_alias_reasoning(dict(m)) for m in chat.messages]
        final = ""
        if chat.continue_final_message:
            final = str(messages[-1].get("content", ""))
            if not isinstance(messages[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message: the final message has no content")
            messages[-1]["content"] = final + CONTINUE_TAG
        context = {
            **self.special_tokens,
            **(chat.kwargs or {}),
            "messages": messages,
            "tools": chat.tools,
            "documents": None,
            "add_generation_prompt": chat.add_generation_prompt,
        }
        pieces: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(context):
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


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: not Jinja's own tojson, which escapes HTML characters: templates expect json.dumps.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes: {name!r}"
            )
