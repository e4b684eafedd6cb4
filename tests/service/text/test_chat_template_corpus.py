"""Sluice renders real chat templates (tests/chat_templates/, see its README for sources) as
transformers' apply_chat_template does, over conversations as clients send them: with None
fields, tools, tool calls, system messages, reasoning and several turns. Each conversation goes
through the Python client's ChatPrompt and the service's conversion, as a request does."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from sluice_client.requests import chat_prompt

from service.rpc.chat import to_chat
from service.text.chat_template import ChatTemplate, ChatTemplateError
from tests.support.tiny_models import make_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "chat_templates"
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Paris <b>&</b>"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "abc123XYZ",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
OPENAI_CALL = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USER = {"role": "user", "content": "The quick brown fox?"}
SYSTEM = {"role": "system", "content": "You are terse. Café 日本語 <b>&</b>"}
# name: (messages, apply_chat_template's options)
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "user": ([USER], {}),
    "system": ([SYSTEM, USER], {}),
    "multi_turn": (
        [SYSTEM, USER, {"role": "assistant", "content": "  A fox.  "}, USER],
        {},
    ),
    "no_generation_prompt": ([USER, {"role": "assistant", "content": "A fox."}], {"g": False}),
    # What OpenAI-style Python clients send: every optional field, None where unused.
    "none_fields": (
        [
            {**SYSTEM, "name": None, "tool_calls": None},
            {**USER, "name": None, "tool_calls": None, "tool_call_id": None},
            {"role": "assistant", "content": "A fox.", "tool_calls": None, "refusal": None},
            {**USER, "tool_calls": None},
        ],
        {},
    ),
    "tools": ([SYSTEM, USER], {"tools": [TOOL]}),
    "tool_calls": (
        [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "abc123XYZ"},
        ],
        {"tools": [TOOL]},
    ),
    "openai_tool_calls": (
        [
            USER,
            {"role": "assistant", "content": "", "tool_calls": [OPENAI_CALL], "name": None},
            {"role": "tool", "content": "21 C", "tool_call_id": "abc123XYZ", "name": None},
            {"role": "assistant", "content": "It is 21 C.", "tool_calls": None},
            USER,
        ],
        {"tools": [TOOL]},
    ),
    "reasoning": (
        [
            USER,
            {"role": "assistant", "content": "A fox.", "reasoning_content": "Foxes are quick."},
            USER,
        ],
        {},
    ),
    "continue_final_message": (
        [USER, {"role": "assistant", "content": "The fox"}],
        {"g": False, "continue_final_message": True},
    ),
    "thinking_off": ([USER], {"kwargs": {"enable_thinking": False}}),
    "text_blocks": (
        [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox?"}]}],
        {},
    ),
    "assistant_first": ([{"role": "assistant", "content": "Hi."}, USER], {}),
}


def template_paths() -> list[Path]:
    return sorted(p for p in TEMPLATES.rglob("*.jinja"))


@pytest.fixture(scope="module")
def reference():
    """A transformers tokenizer with the special tokens the Sluice templates get."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(), **SPECIAL_TOKENS)


def transformers_text(tokenizer, source: str, messages, options) -> str:
    return tokenizer.apply_chat_template(
        copy.deepcopy(messages),
        chat_template=source,
        tools=options.get("tools"),
        tokenize=False,
        add_generation_prompt=options.get("g", True),
        continue_final_message=options.get("continue_final_message", False),
        **options.get("kwargs", {}),
    )


def sluice_text(template: ChatTemplate, messages, options) -> str:
    prompt = chat_prompt(
        messages,
        tools=options.get("tools"),
        add_generation_prompt=options.get("g", True),
        continue_final_message=options.get("continue_final_message", False),
        template_kwargs=options.get("kwargs"),
    )
    return template.render(to_chat(prompt), max_chars=10**7)


@pytest.mark.parametrize("path", template_paths(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_real_templates_render_as_transformers_does(reference, path):
    source = path.read_text()
    template = ChatTemplate(source, SPECIAL_TOKENS)
    for name, (messages, options) in CONVERSATIONS.items():
        try:
            expected = transformers_text(reference, source, messages, options)
        except Exception:  # transformers refuses: so must Sluice
            with pytest.raises(ChatTemplateError):
                sluice_text(template, messages, options)
            continue
        assert sluice_text(template, messages, options) == expected, name
