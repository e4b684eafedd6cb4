"""ChatTemplate renders and tokenizes as transformers' apply_chat_template(tokenize=True), for
the real templates of Llama 3, Mistral, Qwen2.5 and Qwen3 on tiny checkpoints."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from service.text.chat_template import Chat, ChatTemplate, ChatTemplateError, RenderTooLong
from service.text.tokenizer import Tokenizer
from tests.support.tiny_models import CHAT_FAMILIES, make_tokenizer, write_chat_tokenizer

WEATHER_TOOL = {
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
TOOL_CALL = {
    "id": "abc123XYZ",  # Mistral's template wants 9 characters
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
SYSTEM_AND_USER = [
    {"role": "system", "content": "You are terse. Café 日本語"},
    {"role": "user", "content": "The quick brown fox?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Call me Ishmael."},
    {"role": "assistant", "content": "  Hello, Ishmael.  "},
    {"role": "user", "content": "It was the best of times 😀"},
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "abc123XYZ"},
]
CASES = [
    ("system", SYSTEM_AND_USER, {}),
    ("multi_turn", MULTI_TURN, {}),
    ("no_generation_prompt", MULTI_TURN[:2], {"add_generation_prompt": False}),
    ("tools", SYSTEM_AND_USER[1:], {"tools": [WEATHER_TOOL]}),
    ("tool_calls", TOOL_TURNS, {"tools": [WEATHER_TOOL]}),
    (
        "continue_final_message",
        [*MULTI_TURN[:1], {"role": "assistant", "content": "The sea was"}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
]
QWEN3_CASES = [
    ("thinking_off", SYSTEM_AND_USER, {"kwargs": {"enable_thinking": False}}),
    ("thinking_on", SYSTEM_AND_USER, {"kwargs": {"enable_thinking": True}}),
    (
        "reasoning_in_history",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "<think>\nSum.\n</think>\n\n6"},
        ],
        {"add_generation_prompt": False},
    ),
]


def transformers_ids(directory, chat: Chat) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    out = tok.apply_chat_template(
        chat.messages,
        tools=chat.tools,
        tokenize=True,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        **(chat.kwargs or {}),
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def sluice_ids(directory, chat: Chat) -> list[int]:
    template = ChatTemplate.load(directory)
    assert template is not None
    text = template.render(chat, max_chars=10**6)
    return asyncio.run(Tokenizer(directory).encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", sorted(CHAT_FAMILIES))
@pytest.mark.parametrize("name, messages, options", CASES, ids=[c[0] for c in CASES])
def test_ids_equal_transformers_apply_chat_template(tmp_path, family, name, messages, options):
    directory = write_chat_tokenizer(tmp_path, family)
    # A fixed date: Llama 3's template would otherwise read the clock (strftime_now).
    chat = Chat(messages=messages, **{"kwargs": {"date_string": "26 Jul 2024"}, **options})
    ids = sluice_ids(directory, chat)
    assert ids == transformers_ids(directory, chat)
    # The template's markers are whole tokens (ids past the trained vocabulary), not text.
    assert any(i >= make_tokenizer().get_vocab_size() for i in ids)


@pytest.mark.parametrize("name, messages, options", QWEN3_CASES, ids=[c[0] for c in QWEN3_CASES])
def test_qwen3_thinking_switch_equals_transformers(tmp_path, name, messages, options):
    directory = write_chat_tokenizer(tmp_path, "qwen3")
    chat = Chat(messages=messages, **options)
    assert sluice_ids(directory, chat) == transformers_ids(directory, chat)


def test_qwen3_thinking_off_writes_an_empty_think_block(tmp_path):
    template = ChatTemplate.load(write_chat_tokenizer(tmp_path, "qwen3"))
    assert template is not None
    off = template.render(Chat(SYSTEM_AND_USER, kwargs={"enable_thinking": False}), 10**6)
    on = template.render(Chat(SYSTEM_AND_USER), 10**6)
    assert off == on + "<think>\n\n</think>\n\n"


def test_llama3_reads_todays_date_like_transformers(tmp_path):
    directory = write_chat_tokenizer(tmp_path, "llama3")
    chat = Chat(SYSTEM_AND_USER)
    assert sluice_ids(directory, chat) == transformers_ids(directory, chat)


def test_a_chat_template_jinja_file_is_read_like_the_config(tmp_path):
    in_config = ChatTemplate.load(write_chat_tokenizer(tmp_path / "a", "qwen2_5"))
    in_file = ChatTemplate.load(write_chat_tokenizer(tmp_path / "b", "qwen2_5", in_config=False))
    assert in_config is not None and in_file is not None
    assert in_file.render(Chat(MULTI_TURN), 10**6) == in_config.render(Chat(MULTI_TURN), 10**6)


def test_a_named_template_list_uses_the_default(tmp_path):
    directory = write_chat_tokenizer(tmp_path, "qwen2_5")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0].content }}"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(directory)
    assert template is not None and template.render(Chat(MULTI_TURN), 100) == "Call me Ishmael."


def test_a_checkpoint_without_a_template_has_none_unless_overridden(tmp_path):
    directory = write_chat_tokenizer(tmp_path, "llama3", in_config=False)
    (directory / "chat_template.jinja").unlink()
    assert ChatTemplate.load(directory) is None
    override = tmp_path / "t.jinja"
    override.write_text("{{ bos_token }}{{ messages | length }}")
    template = ChatTemplate.load(directory, override)
    assert template is not None and template.render(Chat(MULTI_TURN), 100) == "<|begin_of_text|>3"


def test_raise_exception_in_the_template_is_a_chat_template_error(tmp_path):
    template = ChatTemplate.load(write_chat_tokenizer(tmp_path, "mistral"))
    assert template is not None
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(Chat([{"role": "assistant", "content": "x"}]), 10**6)


def test_any_other_template_failure_is_a_chat_template_error():
    template = ChatTemplate("{{ messages[0].content + 1 }}", {})
    with pytest.raises(ChatTemplateError, match="TypeError"):
        template.render(Chat(MULTI_TURN), 100)


def test_the_sandbox_refuses_reaching_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        template.render(Chat(MULTI_TURN), 100)


def test_rendering_stops_once_past_the_limit():
    template = ChatTemplate("{% for i in range(100000) %}xxxxxxxxxx{% endfor %}", {})
    with pytest.raises(RenderTooLong):
        template.render(Chat(MULTI_TURN), 1000)


def test_tojson_keeps_html_and_unicode_as_transformers_does():
    template = ChatTemplate("{{ tools | tojson }}", {})
    text = template.render(Chat(MULTI_TURN, tools=[{"d": "<b>&é"}]), 100)
    assert text == '[{"d": "<b>&é"}]'


def test_a_template_that_does_not_parse_names_its_file(tmp_path):
    directory = write_chat_tokenizer(tmp_path, "qwen3")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for %}")
    with pytest.raises(ValueError, match=r"broken\.jinja does not parse"):
        ChatTemplate.load(directory, broken)


def test_a_template_with_generation_tags_loads_and_renders_as_transformers(tmp_path):
    # TRL's training templates (and LFM2.5's own) mark assistant turns with {% generation %}.
    directory = write_chat_tokenizer(tmp_path, "llama3")
    override = Path(__file__).resolve().parents[2] / "chat_templates/trl/llama3_training.jinja"
    template = ChatTemplate.load(directory, override)
    assert template is not None
    chat = Chat(MULTI_TURN, kwargs={"date_string": "26 Jul 2024"})
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        MULTI_TURN,
        chat_template=override.read_text(),
        tokenize=False,
        add_generation_prompt=True,
        date_string="26 Jul 2024",
    )
    assert template.render(chat, 10**6) == expected


def test_a_chat_with_tools_uses_the_tool_use_template_as_transformers(tmp_path):
    directory = write_chat_tokenizer(tmp_path, "qwen2_5")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(directory)
    assert template is not None
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(directory)
    for tools in (None, [WEATHER_TOOL]):
        expected = reference.apply_chat_template(MULTI_TURN, tools=tools, tokenize=False)
        rendered = template.render(Chat(MULTI_TURN, tools=tools, add_generation_prompt=False), 100)
        assert rendered == expected


def test_template_arguments_cannot_set_what_the_chat_sets():
    # transformers fails too (a second value for a keyword argument of render).
    template = ChatTemplate("{{ messages | length }}", {})
    with pytest.raises(ChatTemplateError, match="messages"):
        template.render(Chat(MULTI_TURN, kwargs={"messages": []}), 100)
