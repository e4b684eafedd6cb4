"""The Python client's chat prompts: what build_request and chat_prompt put on the wire."""

from __future__ import annotations

import json

import pytest
from sluice_client import build_request, chat_prompt, pb

MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
]


def test_a_list_of_messages_is_a_chat_prompt_with_extra_keys_as_json():
    request = build_request(MESSAGES, max_tokens=4)
    assert request.WhichOneof("prompt") == "chat"
    first, second = request.chat.messages
    assert (first.role, first.content, first.extra_json) == ("user", "Weather in Paris?", "")
    assert (second.role, second.content) == ("assistant", "")
    # content None: the template sees no content key, as transformers drops None-valued keys.
    assert json.loads(second.extra_json) == {
        "tool_calls": [{"function": {"name": "f"}}],
        "content": None,
    }
    assert not request.chat.HasField("add_generation_prompt")  # the server's default: true


def test_none_valued_keys_are_dropped_and_non_text_content_travels_as_json():
    blocks = [{"type": "text", "text": "Hi"}]
    prompt = chat_prompt(
        [
            {"role": "user", "content": "Hi", "tool_calls": None, "name": None},
            {"role": "user", "content": blocks},
        ]
    )
    plain, listed = prompt.messages
    assert (plain.content, plain.extra_json) == ("Hi", "")
    assert (listed.content, json.loads(listed.extra_json)) == ("", {"content": blocks})


def test_chat_extras_travel_as_json_and_explicit_flags():
    request = build_request(
        MESSAGES,
        tools=[{"type": "function"}],
        add_generation_prompt=False,
        continue_final_message=True,
        template_kwargs={"enable_thinking": False},
    )
    chat = request.chat
    assert json.loads(chat.tools_json) == [{"type": "function"}]
    assert json.loads(chat.template_kwargs_json) == {"enable_thinking": False}
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert chat.continue_final_message


def test_a_chat_prompt_message_is_used_as_given():
    prompt = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")])
    assert build_request(prompt).chat == prompt
    assert chat_prompt(prompt, add_generation_prompt=True).add_generation_prompt


def test_chat_extras_without_a_chat_are_a_value_error():
    with pytest.raises(ValueError, match="chat prompt"):
        build_request("text", template_kwargs={"x": 1})
    assert build_request([1, 2, 3]).token_ids.ids == [1, 2, 3]
